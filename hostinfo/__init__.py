"""What dsv41 knows about the machine it runs on, below every other package (kernels <- runtime <-
autotune <- reports all read the host through here): facts with test overrides (`facts`), the
profile fingerprint (`fingerprint`), and timing statistics (`measure`)."""
from hostinfo.machine import (HostFactError, HostFacts, amx_tiles, arch, clamp_threads, cpu_flags, cpu_model, cuda_available, facts,
                            isa, l1d_bytes, llc_bytes, llc_domains, numa_nodes, numba_threading_layer, o_direct_refusal, probe_budget_bytes,
                            ram_available_bytes, overrides, ram_total_bytes, runnable_isas, usable_cores)

__all__ = ["HostFactError", "HostFacts", "amx_tiles", "arch", "clamp_threads", "cpu_flags", "cpu_model", "cuda_available", "facts",
           "isa", "l1d_bytes", "llc_bytes", "llc_domains", "numa_nodes", "o_direct_refusal", "ram_available_bytes", "ram_total_bytes",
           "runnable_isas", "usable_cores", "overrides", "probe_budget_bytes", "numba_threading_layer"]
