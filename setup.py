from setuptools import find_packages, setup

setup(
    name="ds_odc",
    version="0.1.0",
    description="DeepSpeed ZeRO-3 with on-demand one-sided communication (ODC) for LLM post-training",
    packages=find_packages(include=["ds_odc", "ds_odc.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "deepspeed==0.19.8",
        "pydantic>=2.0",
        "ninja",
    ],
    extras_require={"test": ["pytest>=8", "tqdm"], "examples": ["tqdm"]},
)
