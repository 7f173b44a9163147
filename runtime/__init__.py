"""The hybrid runtime. The kernels package first: it sets the process up before torch loads (kernels/__init__.py)."""
import kernels  # noqa: F401
