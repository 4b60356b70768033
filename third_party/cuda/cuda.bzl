"""cuda_library: .cu files compiled by nvcc and linked like any cc_library.

    load("//third_party/cuda:cuda.bzl", "cuda_library")

    cuda_library(
        name = "format_kernels",
        srcs = ["format_kernels.cu"],
        hdrs = ["format_kernels.h"],      # plain C++: no device code, no CUDA headers needed
        nocuda_srcs = ["format_kernels_nocuda.cc"],  # optional: the same symbols without CUDA
        host_srcs = ["format_helpers.cc"],  # optional: .cc compiled in both modes
        deps = [":formats"],
    )

Objects are compiled with -fPIC for every architecture in //third_party/cuda:archs (machine code
for each, plus PTX of the highest so newer GPUs can JIT it). When CUDA is off (no toolkit found, or
--config=nocuda) the .cu files are not compiled and `nocuda_srcs` are used instead; the C++ side
sees MOE_HAVE_CUDA=0 through //third_party/cuda:cuda_config.
"""

load("@local_cuda//:defs.bzl", "CUDA_PATH")

BoolValue = provider(fields = ["value"])
StringListValue = provider(fields = ["value"])

def _bool_setting_impl(ctx):
    return [BoolValue(value = ctx.build_setting_value)]

bool_setting = rule(
    implementation = _bool_setting_impl,
    build_setting = config.bool(flag = True),
)

def _string_list_setting_impl(ctx):
    return [StringListValue(value = ctx.build_setting_value)]

string_list_setting = rule(
    implementation = _string_list_setting_impl,
    build_setting = config.string_list(flag = True),
)

def _arch_number(arch):
    for prefix in ["sm_", "compute_"]:
        if arch.startswith(prefix):
            return arch[len(prefix):]
    fail("CUDA architecture '%s' is not of the form sm_NN" % arch)

def _arch_value(arch):
    # "90a" (architecture-specific features) sorts with 90.
    return int(arch.rstrip("af"))

def _cuda_objects_impl(ctx):
    if not ctx.attr._enabled[BoolValue].value:
        return [DefaultInfo(files = depset())]
    archs = [_arch_number(a) for a in ctx.attr._archs[StringListValue].value]
    if not archs:
        fail("//third_party/cuda:archs is empty")
    highest = archs[0]
    for a in archs:
        if _arch_value(a) > _arch_value(highest):
            highest = a
    gencode = []
    for a in archs:
        gencode += ["-gencode", "arch=compute_%s,code=sm_%s" % (a, a)]
    gencode += ["-gencode", "arch=compute_%s,code=compute_%s" % (highest, highest)]

    headers = [depset(ctx.files.hdrs)]
    includes = [".", ctx.bin_dir.path, ctx.genfiles_dir.path]
    system_includes = []
    defines = []
    for dep in ctx.attr.deps:
        cc = dep[CcInfo].compilation_context
        headers.append(cc.headers)
        includes += cc.includes.to_list() + cc.quote_includes.to_list()
        system_includes += cc.system_includes.to_list()
        defines += cc.defines.to_list()
    inputs = depset(ctx.files.srcs, transitive = headers)
    if not CUDA_PATH:
        fail("CUDA is enabled but no toolkit was found (set CUDA_PATH); build with --config=nocuda")

    # nvcc is run from the toolkit itself: it locates cicc, ptxas and its profile next to its own
    # path, which a sandboxed symlink would hide.
    nvcc = CUDA_PATH + "/bin/nvcc"

    outs = []
    for src in ctx.files.srcs:
        stem = src.basename[:-len(".cu")]
        pic = ctx.actions.declare_file("_cuda_objs/%s/%s.pic.o" % (ctx.label.name, stem))
        args = ctx.actions.args()
        args.add_all(["-std=c++17", "-O3", "-lineinfo", "--expt-relaxed-constexpr"])
        args.add_all(["-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror,-Wno-unused-parameter"])
        args.add_all(["-Werror", "all-warnings"])
        args.add_all(gencode)
        args.add_all(["MOE_HAVE_CUDA=1"] + defines, before_each = "-D")
        args.add_all(includes, before_each = "-I")
        args.add_all(system_includes, before_each = "-isystem")
        args.add_all(ctx.attr.copts)
        args.add_all(["-c", src.path, "-o", pic.path])
        ctx.actions.run(
            executable = nvcc,
            arguments = [args],
            inputs = inputs,
            outputs = [pic],
            mnemonic = "Nvcc",
            progress_message = "nvcc %s" % src.short_path,
            use_default_shell_env = True,
        )
        outs.append(pic)
    return [DefaultInfo(files = depset(outs))]

_cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "_enabled": attr.label(default = "//third_party/cuda:enabled"),
        "_archs": attr.label(default = "//third_party/cuda:archs"),
    },
)

def cuda_library(name, srcs, hdrs = [], deps = [], nocuda_srcs = [], host_srcs = [], copts = [], nvcc_copts = [], **kwargs):
    """A cc_library whose srcs are .cu files compiled by nvcc (see the file comment).

    host_srcs: .cc files compiled by the C++ compiler in both modes (host-side helpers).
    """
    _cuda_objects(
        name = name + "_cuda_objs",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps + ["//third_party/cuda:cudart"],
        copts = nvcc_copts,
        visibility = ["//visibility:private"],
        tags = kwargs.get("tags", []),
    )
    native.cc_library(
        name = name,
        srcs = host_srcs + select({
            "//third_party/cuda:cuda_on": [":" + name + "_cuda_objs"],
            "//conditions:default": nocuda_srcs,
        }),
        hdrs = hdrs,
        copts = copts,
        deps = deps + ["//third_party/cuda:cudart"],
        **kwargs
    )
