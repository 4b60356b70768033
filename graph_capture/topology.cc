#include "graph_capture/topology.h"

#include <map>
#include <string>

#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda.h>  // driver types only; the entry points come from cudaGetDriverEntryPointByVersion
#include <cuda_runtime_api.h>
#endif

namespace moe::graph_capture {

std::vector<int> GraphTopology::Predecessors(int node) const {
  std::vector<int> out;
  for (const auto& [from, to] : edges) {
    if (to == node) out.push_back(from);
  }
  return out;
}

std::vector<int> GraphTopology::Successors(int node) const {
  std::vector<int> out;
  for (const auto& [from, to] : edges) {
    if (from == node) out.push_back(to);
  }
  return out;
}

std::vector<int> GraphTopology::KernelsNamed(const std::string& fragment) const {
  std::vector<int> out;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].kind == NodeKind::kKernel &&
        nodes[i].kernel.find(fragment) != std::string::npos) {
      out.push_back(static_cast<int>(i));
    }
  }
  return out;
}

#if MOE_HAVE_CUDA

namespace {

NodeKind KindOf(cudaGraphNodeType type) {
  switch (type) {
    case cudaGraphNodeTypeKernel: return NodeKind::kKernel;
    case cudaGraphNodeTypeMemcpy: return NodeKind::kMemcpy;
    case cudaGraphNodeTypeMemset: return NodeKind::kMemset;
    case cudaGraphNodeTypeHost: return NodeKind::kHost;
    case cudaGraphNodeTypeGraph: return NodeKind::kChildGraph;
    case cudaGraphNodeTypeEmpty: return NodeKind::kEmpty;
    case cudaGraphNodeTypeWaitEvent: return NodeKind::kEventWait;
    case cudaGraphNodeTypeEventRecord: return NodeKind::kEventRecord;
    case cudaGraphNodeTypeMemAlloc: return NodeKind::kMemAlloc;
    case cudaGraphNodeTypeMemFree: return NodeKind::kMemFree;
    default: return NodeKind::kOther;
  }
}

// The kernel's name through the driver API, which knows every kernel node (library kernels
// launched with cuLaunchKernel included), where the runtime's cudaFuncGetName only knows entry
// functions of this program. Empty when the driver cannot say.
std::string KernelName(cudaGraphNode_t node) {
  using GetParamsFn = CUresult (*)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
  using FuncNameFn = CUresult (*)(const char**, CUfunction);
  using KernelNameFn = CUresult (*)(const char**, CUkernel);
  static GetParamsFn get_params = nullptr;
  static FuncNameFn func_name = nullptr;
  static KernelNameFn kernel_name = nullptr;
  static const bool resolved = [] {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuGraphKernelNodeGetParams", &fn, CUDA_VERSION,
                                         cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      get_params = reinterpret_cast<GetParamsFn>(fn);
    }
    if (cudaGetDriverEntryPointByVersion("cuFuncGetName", &fn, CUDA_VERSION, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      func_name = reinterpret_cast<FuncNameFn>(fn);
    }
    if (cudaGetDriverEntryPointByVersion("cuKernelGetName", &fn, CUDA_VERSION, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      kernel_name = reinterpret_cast<KernelNameFn>(fn);
    }
    cudaGetLastError();
    return true;
  }();
  (void)resolved;
  if (get_params == nullptr) return "";
  CUDA_KERNEL_NODE_PARAMS params{};
  if (get_params(reinterpret_cast<CUgraphNode>(node), &params) != CUDA_SUCCESS) return "";
  const char* name = nullptr;
  if (params.func != nullptr && func_name != nullptr &&
      func_name(&name, params.func) == CUDA_SUCCESS && name != nullptr) {
    return name;
  }
  if (params.kern != nullptr && kernel_name != nullptr &&
      kernel_name(&name, params.kern) == CUDA_SUCCESS && name != nullptr) {
    return name;
  }
  return "";
}

}  // namespace

absl::StatusOr<GraphTopology> ReadTopology(CUgraph_st* graph) {
  RETURN_IF_ERROR(common::CudaAvailable());
  if (graph == nullptr) return absl::InvalidArgumentError("no graph");
  GraphTopology t;
  size_t n = 0;
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &n));
  std::map<cudaGraphNode_t, int> index;
  for (size_t i = 0; i < n; ++i) {
    index[nodes[i]] = static_cast<int>(i);
    cudaGraphNodeType type;
    CUDA_RETURN_IF_ERROR(cudaGraphNodeGetType(nodes[i], &type));
    GraphNodeInfo info;
    info.kind = KindOf(type);
    if (info.kind == NodeKind::kKernel) info.kernel = KernelName(nodes[i]);
    t.nodes.push_back(std::move(info));
  }
  size_t e = 0;
  CUDA_RETURN_IF_ERROR(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &e));
  if (e > 0) {
    std::vector<cudaGraphNode_t> from(e), to(e);
    std::vector<cudaGraphEdgeData> data(e);
    CUDA_RETURN_IF_ERROR(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &e));
    for (size_t i = 0; i < e; ++i) t.edges.push_back({index[from[i]], index[to[i]]});
  }
  return t;
}

#else  // !MOE_HAVE_CUDA

absl::StatusOr<GraphTopology> ReadTopology(CUgraph_st*) {
  return absl::UnavailableError("graph_capture: built without CUDA");
}

#endif  // MOE_HAVE_CUDA

}  // namespace moe::graph_capture
