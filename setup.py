"""Install rltrain. Versions live in rltrain/requirements.py (also read by `rltrain doctor`)."""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

req = runpy.run_path(str(Path(__file__).parent / "rltrain" / "requirements.py"))

setup(
    name="rltrain",
    version="0.1.0",
    description="Megatron-Core + vLLM + Ray RL trainer for LLMs (PPO, GRPO, RLOO, REINFORCE++)",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",
    packages=find_packages(
        include=["rltrain", "rltrain.*", "megatron_bridge", "megatron_bridge.*", "kernels", "kernels.*"]
    ),
    install_requires=req["CORE"],
    extras_require=req["EXTRAS"],
    entry_points={"console_scripts": ["rltrain=rltrain.cli:main"]},
    license="Apache-2.0",
)
