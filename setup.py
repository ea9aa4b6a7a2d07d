from setuptools import find_packages, setup

setup(
    name="complete_verifier_ext",
    version="0.1.0",
    description="Sharded neural-network verifier (IBP, CROWN, alpha-CROWN) with FSDP/TP bound propagation",
    packages=find_packages(include=["complete_verifier_ext", "complete_verifier_ext.*"]),
    package_data={"complete_verifier_ext": ["examples/*.onnx", "examples/*.vnnlib", "examples/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "onnx",
        "onnxruntime",
        "pyyaml",
        "scipy>=1.9",
        "highspy>=1.7",
        "tqdm",
    ],
    extras_require={"test": ["pytest", "matplotlib", "ruff"]},
    entry_points={"console_scripts": ["abcrown=complete_verifier_ext.cli:main"]},
)
