from setuptools import find_packages, setup

ABCROWN_DEPS = [
    "onnxoptimizer",
    "skl2onnx",
    "gurobipy",
    "psutil",
    "sortedcontainers",
    "pandas",
    "termcolor",
    "appdirs",
    "graphviz",
    "ninja",
    "sympy",
    "packaging",
]

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
        "threadpoolctl",  # the proof checker's forked workers: one BLAS thread each
        "tqdm",
        # the reference VNN-LIB 2.0 parser (VNN-COMP 2026); C++ wheels for CPython 3.10-3.13
        'vnnlib>=1.0.2; python_version < "3.14"',
    ],
    extras_require={
        # what α,β-CROWN (general.engine: abcrown, $ABCROWN_PATH) imports on the ONNX + VNN-LIB path; it
        # cannot be installed from the package index itself (see docs/abcrown_plugin.md)
        "abcrown": ABCROWN_DEPS,
        "test": ["pytest", "pytest-xdist", "filelock", "matplotlib", "ruff>=0.17,<0.18", *ABCROWN_DEPS],
    },
    entry_points={
        "console_scripts": [
            "abcrown=complete_verifier_ext.cli:main",
            # the VNN-LIB 2.0 standard's solver command line (VNNLIB-Solver-Database)
            "complete-verifier-ext=complete_verifier_ext.solver_cli:main",
        ]
    },
)
