// Reads a captured graph back as plain data (node kinds, kernel names, edges), so tests can
// check a decode step's structure: two branches per layer, the fork and join edges in place, no
// node outside the plan. Plain C++ header; without CUDA, ReadTopology returns Unavailable.
#ifndef MOE_GRAPH_CAPTURE_TOPOLOGY_H_
#define MOE_GRAPH_CAPTURE_TOPOLOGY_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

struct CUgraph_st;

namespace moe::graph_capture {

enum class NodeKind {
  kKernel,
  kMemcpy,
  kMemset,
  kHost,
  kChildGraph,
  kEmpty,
  kEventWait,
  kEventRecord,
  kMemAlloc,
  kMemFree,
  kOther,
};

struct GraphNodeInfo {
  NodeKind kind = NodeKind::kOther;
  // Kernel nodes: the (mangled) kernel name where the runtime knows it, else empty.
  std::string kernel;
};

struct GraphTopology {
  std::vector<GraphNodeInfo> nodes;
  std::vector<std::pair<int, int>> edges;  // (from, to) as indices into `nodes`

  std::vector<int> Predecessors(int node) const;
  std::vector<int> Successors(int node) const;
  // Indices of kernel nodes whose name contains `fragment`, in node order.
  std::vector<int> KernelsNamed(const std::string& fragment) const;
};

absl::StatusOr<GraphTopology> ReadTopology(CUgraph_st* graph);

}  // namespace moe::graph_capture

#endif  // MOE_GRAPH_CAPTURE_TOPOLOGY_H_
