#include "engine/forward_model.h"

namespace moe::engine {

KvBlockAllocator::KvBlockAllocator(int num_blocks, int block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

bool KvBlockAllocator::Allocate(int n, std::vector<int32_t>* table) {
  if (n > static_cast<int>(free_.size())) return false;
  for (int i = 0; i < n; ++i) {
    table->push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void KvBlockAllocator::Free(std::vector<int32_t>* table) {
  // Pushed back in reverse so the next Allocate hands out the same low ids first.
  for (auto it = table->rbegin(); it != table->rend(); ++it) free_.push_back(*it);
  table->clear();
}

StateSlotAllocator::StateSlotAllocator(int num_slots) : num_slots_(num_slots) {
  free_.reserve(num_slots);
  for (int s = num_slots - 1; s >= 0; --s) free_.push_back(s);
}

bool StateSlotAllocator::Allocate(int* slot) {
  if (free_.empty()) return false;
  *slot = free_.back();
  free_.pop_back();
  return true;
}

void StateSlotAllocator::Free(int* slot) {
  if (*slot < 0) return;
  free_.push_back(*slot);
  *slot = -1;
}

}  // namespace moe::engine
