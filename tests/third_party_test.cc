// Each Debian-packaged dependency, as surfaced by third_party/, compiles, links and does real
// work: a gRPC round trip on loopback through a cc_grpc_library, JSON, cpp-httplib, oneDNN,
// Highway's target detection and Abseil.
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "dnnl.hpp"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "hwy/targets.h"
#include "nlohmann/json.hpp"
#include "tests/smoke.grpc.pb.h"

namespace moe::tests {
namespace {

class EchoService final : public Echo::Service {
  grpc::Status Say(grpc::ServerContext*, const EchoRequest* request, EchoReply* reply) override {
    int64_t sum = 0;
    for (int32_t id : request->ids()) sum += id;
    reply->set_text(absl::StrCat("echo: ", request->text()));
    reply->set_sum(sum);
    return grpc::Status::OK;
  }
};

TEST(ThirdPartyTest, GrpcRoundTripOnLoopback) {
  EchoService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  auto stub = Echo::NewStub(channel);
  EchoRequest request;
  request.set_text("experts");
  request.add_ids(3);
  request.add_ids(4);
  EchoReply reply;
  grpc::ClientContext context;
  grpc::Status status = stub->Say(&context, request, &reply);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(reply.text(), "echo: experts");
  EXPECT_EQ(reply.sum(), 7);
  server->Shutdown();
}

TEST(ThirdPartyTest, JsonParsesAndDumps) {
  auto j = nlohmann::json::parse(R"({"model": "qwen3_moe", "experts": 128})");
  EXPECT_EQ(j["experts"].get<int>(), 128);
  EXPECT_EQ(nlohmann::json::parse(j.dump()), j);
}

TEST(ThirdPartyTest, HttplibServesLoopback) {
  httplib::Server server;
  server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  const int port = server.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread thread([&] { server.listen_after_bind(); });
  while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  httplib::Client client("127.0.0.1", port);
  httplib::Result res = client.Get("/health");
  const bool ok = static_cast<bool>(res);
  const std::string body = ok ? res->body : "";
  server.stop();
  thread.join();
  ASSERT_TRUE(ok) << httplib::to_string(res.error());
  EXPECT_EQ(body, "ok");
}

TEST(ThirdPartyTest, OneDnnRunsAMatmul) {
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  dnnl::memory::desc a_md({2, 3}, dt::f32, tag::ab), b_md({3, 2}, dt::f32, tag::ab),
      c_md({2, 2}, dt::f32, tag::ab);
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1}, c[4] = {};
  dnnl::memory am(a_md, engine, a), bm(b_md, engine, b), cm(c_md, engine, c);
  dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), engine))
      .execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  stream.wait();
  EXPECT_FLOAT_EQ(c[0], 4);   // 1*1 + 2*0 + 3*1
  EXPECT_FLOAT_EQ(c[1], 5);   // 1*0 + 2*1 + 3*1
  EXPECT_FLOAT_EQ(c[2], 10);  // 4 + 0 + 6
  EXPECT_FLOAT_EQ(c[3], 11);  // 0 + 5 + 6
}

TEST(ThirdPartyTest, HighwayReportsSupportedTargets) {
  const int64_t targets = hwy::SupportedTargets();
  EXPECT_NE(targets, 0);
  EXPECT_NE(targets & HWY_SSE4, 0) << "the SSE4 baseline must be supported to run at all";
}

}  // namespace
}  // namespace moe::tests
