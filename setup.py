import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

# Zero-code-change activation: a .pth file at the top of site-packages runs ds_odc_autoload.install()
# at interpreter start (stdlib only; it imports ds_odc once deepspeed is imported). DS_ODC_AUTOLOAD=0
# turns it off. The name sorts after setuptools' "__editable__.*.pth", which makes the module importable.
AUTOLOAD_PTH = ("ds_odc_autoload.pth", "import ds_odc_autoload; ds_odc_autoload.install()\n")


# The operators' C++/CUDA sources live in ops/csrc (beside the package, as DeepSpeed keeps csrc/); an
# installed package must carry them, or a wheel install could never JIT-build its ops. They are copied
# to ds_odc/ops/csrc in the build, where ds_odc/ops_builder.py looks first (the checkout's ops/ second).
OPS_SOURCES = ("ops/csrc", ("odc_atomics.cpp", "odc_kernels.cu", "odc_kernels.h", "odc_ops.cpp"))
OPS_IN_PACKAGE = os.path.join("ds_odc", "ops", "csrc")


class BuildPyWithAutoload(build_py):
    """Regular installs and wheels: the .pth goes to the root of the build (site-packages), and the
    operators' sources into the package (ds_odc/ops/csrc)."""

    def run(self):
        super().run()
        name, content = AUTOLOAD_PTH
        target = os.path.join(self.build_lib, name)
        with open(target, "w") as pth:
            pth.write(content)
        self.extra_outputs = [target] + self._copy_op_sources()

    def _copy_op_sources(self):
        source_dir, names = OPS_SOURCES
        target_dir = os.path.join(self.build_lib, OPS_IN_PACKAGE)
        os.makedirs(target_dir, exist_ok=True)
        copied = []
        for name in names:
            target = os.path.join(target_dir, name)
            shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), source_dir, name), target)
            copied.append(target)
        return copied

    def get_outputs(self, *args, **kwargs):
        return super().get_outputs(*args, **kwargs) + getattr(self, "extra_outputs", [])


class EditableWheelWithAutoload(editable_wheel):
    """Editable installs (``pip install -e``) put only setuptools' own .pth/finder in the wheel; add ours."""

    def _select_strategy(self, *args, **kwargs):
        return _StrategyWithAutoload(super()._select_strategy(*args, **kwargs))


class _StrategyWithAutoload:
    """setuptools' editable strategy (a context manager that writes files into the wheel), plus our .pth."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self.inner.__exit__(*exc_info)

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        wheel.writestr(*AUTOLOAD_PTH)


# Everything else (name, version, dependencies, packages, license) is PEP 621 metadata in pyproject.toml.
setup(cmdclass={"build_py": BuildPyWithAutoload, "editable_wheel": EditableWheelWithAutoload})
