"""cc_grpc_library: a .proto compiled by Debian's protoc and grpc_cpp_plugin into a cc_library.

    cc_grpc_library(name = "engine_proto", src = "engine.proto")

gives engine.pb.{h,cc} and engine.grpc.pb.{h,cc} (include as "<package>/engine.pb.h").
"""

def cc_grpc_library(name, src, deps = [], grpc = True, **kwargs):
    if not src.endswith(".proto"):
        fail("cc_grpc_library: src must be a .proto file")
    stem = src[:-len(".proto")]
    outs = [stem + ".pb.h", stem + ".pb.cc"]
    if grpc:
        outs += [stem + ".grpc.pb.h", stem + ".grpc.pb.cc"]
    pkg = native.package_name()
    proto_path = (pkg + "/" if pkg else "") + src
    cmd = "/usr/bin/protoc -I. -I/usr/include --cpp_out=$(GENDIR) "
    if grpc:
        cmd += "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin "
    cmd += proto_path
    native.genrule(
        name = name + "_gen",
        srcs = [src],
        outs = outs,
        cmd = cmd,
        message = "protoc " + proto_path,
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party/grpc"],
        **kwargs
    )
