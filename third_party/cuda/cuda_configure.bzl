"""Finds the local CUDA toolkit and exposes it as a repository.

The repository always resolves. With a toolkit it links `cuda/` to it and defines `cudart`,
`cublas` and `headers`; without one those targets are empty and `CUDA_FOUND` is False, so the tree
builds CPU-only. The toolkit is looked for at $CUDA_PATH, then /usr/local/cuda.
"""

_BUILD_FOUND = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob(["cuda/include/**"]),
    includes = ["cuda/include"],
)

cc_library(
    name = "cudart",
    linkopts = [
        "-L{path}/lib64",
        "-Wl,-rpath,{path}/lib64",
        "-lcudart",
    ],
    deps = [":headers"],
)

cc_library(
    name = "cublas",
    linkopts = [
        "-L{path}/lib64",
        "-lcublas",
        "-lcublasLt",
    ],
    deps = [":cudart"],
)

exports_files(["cuda/bin/nvcc"])

filegroup(
    name = "nvcc",
    srcs = ["cuda/bin/nvcc"],
)
"""

_BUILD_MISSING = """
package(default_visibility = ["//visibility:public"])

cc_library(name = "headers")

cc_library(name = "cudart")

cc_library(name = "cublas")

filegroup(name = "nvcc")
"""

def _cuda_configure_impl(rctx):
    path = rctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = rctx.path(path + "/bin/nvcc")
    found = nvcc.exists and rctx.path(path + "/include/cuda_runtime.h").exists
    if found:
        rctx.symlink(path, "cuda")
        rctx.file("BUILD", _BUILD_FOUND.format(path = path))
    else:
        rctx.file("BUILD", _BUILD_MISSING)
    rctx.file("defs.bzl", "CUDA_FOUND = %s\nCUDA_PATH = %r\n" % (found, path if found else ""))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
