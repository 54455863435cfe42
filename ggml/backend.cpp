// libggml-kda: a ggml backend that runs GGML_OP_GATED_DELTA_NET on kda.
//
// ggml loads it at run time (GGML_BACKEND_PATH=/path/libggml-kda.so, or ggml_backend_load()): one
// ACCEL device on host memory, as ggml-blas is, that claims the gated delta net nodes kda computes
// exactly as ggml's CPU op does (gated_delta_net.cpp) and leaves every other node, and every layout
// it declines, to ggml's CPU backend. When the node's state snapshots are copied into a recurrent
// cache by the copy node that follows (llama.cpp's graph), it takes that copy too and writes the
// states straight into the cache, as kda's state pools are updated in place.
#include <kda/version.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <kda/kda.hpp>
#include <mutex>
#include <set>
#include <string>

#include "gated_delta_net.hpp"
#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml.h"
#include "host_ops.hpp"

namespace {

constexpr const char* kName = "KDA";

struct BackendContext {
  // ggml's thread count once a caller sets it (llama.cpp does); until then kda's default, the
  // KDA_NUM_THREADS variable or every core.
  int n_threads = 0;
  kda::Context context;  // kda's worker threads and working memory, kept between graphs
};

// Logs each distinct reason for declining a node once: supports_op is asked for every node of every
// graph.
void log_decline_once(const std::string& why) {
  static std::mutex mutex;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> lock(mutex);
  if (said.insert(why).second)
    GGML_LOG_INFO("%s: GATED_DELTA_NET left to another backend: %s\n", "ggml-kda", why.c_str());
}

// Says once per process that kda runs the op, with the first node's shape: a user reading llama.cpp's
// log then knows the backend is in use, not only loaded.
void log_first_node(const ggml_tensor* node) {
  static std::once_flag once;
  std::call_once(once, [node] {
    const ggml_tensor* v = node->src[2];
    GGML_LOG_INFO(
        "%s: GATED_DELTA_NET runs on kda (first node: S=%lld, H_k=%lld, H_v=%lld, T=%lld, N=%lld, %s gate)\n",
        "ggml-kda", static_cast<long long>(v->ne[0]), static_cast<long long>(node->src[0]->ne[1]),
        static_cast<long long>(v->ne[1]), static_cast<long long>(v->ne[2]), static_cast<long long>(v->ne[3]),
        node->src[3]->ne[0] == 1 ? "scalar" : "per-channel");
  });
}

// Says once per process that the copy into the recurrent cache was fused away.
void log_fused_copy_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    GGML_LOG_INFO(
        "%s: GATED_DELTA_NET writes its states straight into the recurrent cache (the copy is fused)\n",
        "ggml-kda");
  });
}

bool is_view_or_noop(const ggml_tensor* t) {
  switch (t->op) {
    case GGML_OP_NONE:
    case GGML_OP_RESHAPE:
    case GGML_OP_VIEW:
    case GGML_OP_PERMUTE:
    case GGML_OP_TRANSPOSE: return true;
    default: return ggml_is_empty(t);
  }
}

bool overlaps(const ggml_tensor* a, const char* lo, const char* hi) {
  const char* a_lo = static_cast<const char*>(a->data);
  const char* a_hi = a_lo + ggml_nbytes(a);
  return a_lo < hi && lo < a_hi;
}

// The copy of a gated delta net's state snapshots into a recurrent cache, as llama.cpp writes it:
// `cpy` copies a contiguous view of the result's states (all the snapshots it wrote) into a view of
// the cache. Returns the cache target, or none.
kda_ggml::StateTarget cache_copy_target(const ggml_tensor* gdn, const ggml_tensor* cpy) {
  if (gdn->op != GGML_OP_GATED_DELTA_NET || cpy->op != GGML_OP_CPY) return {};
  if ((gdn->flags & GGML_TENSOR_FLAG_OUTPUT) || (cpy->flags & GGML_TENSOR_FLAG_OUTPUT)) return {};
  const ggml_tensor* from = cpy->src[0];
  const ggml_tensor* cache = cpy->src[1];
  const ggml_tensor* v = gdn->src[2];
  const int64_t S = v->ne[0], H = v->ne[1], T = v->ne[2], N = v->ne[3];
  const int64_t written = std::min<int64_t>(T, gdn->op_params[0]);
  const size_t states_at = sizeof(float) * static_cast<size_t>(S * H * T * N);
  if (from->op != GGML_OP_VIEW || from->view_src != gdn || from->view_offs != states_at ||
      !ggml_is_contiguous(from) || from->type != GGML_TYPE_F32 ||
      ggml_nelements(from) != written * N * H * S * S)
    return {};
  // The cache view: [S*S*H_v, N, snapshots] with contiguous rows (llama.cpp's Qwen graphs), or any
  // contiguous run of those floats in that order (its Kimi Linear graph copies into a 1-D view).
  const int64_t D = S * S * H;
  int64_t sequence_stride = D, snapshot_stride = N * D;
  if (cache->type != GGML_TYPE_F32 || ggml_nelements(cache) != written * N * D) return {};
  if (!ggml_is_contiguous(cache)) {
    if (cache->nb[0] != sizeof(float) || cache->ne[0] != D || cache->ne[1] != N || cache->ne[2] != written ||
        cache->ne[3] != 1 || cache->nb[1] % sizeof(float) != 0 || cache->nb[2] % sizeof(float) != 0)
      return {};
    sequence_stride = static_cast<int64_t>(cache->nb[1] / sizeof(float));
    snapshot_stride = static_cast<int64_t>(cache->nb[2] / sizeof(float));
  }
  // The cache must be apart from the node's inputs: kda reads them while it writes the states.
  const char* lo = static_cast<const char*>(cache->data);
  const char* hi = lo + ggml_nbytes(cache);
  for (int i = 0; i < 6; ++i)
    if (overlaps(gdn->src[i], lo, hi)) return {};
  kda_ggml::StateTarget target;
  target.cache = static_cast<float*>(cache->data);
  target.sequence_stride = sequence_stride;
  target.snapshot_stride = snapshot_stride;
  return target;
}

// The copy node after `gdn` that cache_copy_target() accepts: the graph's next node that is not a
// view, or -1.
int fused_copy_index(const ggml_cgraph* graph, int gdn_index, kda_ggml::StateTarget* target) {
  for (int j = gdn_index + 1; j < graph->n_nodes; ++j) {
    const ggml_tensor* node = graph->nodes[j];
    if (is_view_or_noop(node)) continue;
    *target = cache_copy_target(graph->nodes[gdn_index], node);
    return target->cache != nullptr ? j : -1;
  }
  return -1;
}

// The copies the backend claims: those of a gated delta net's result it runs (the state into a
// cache, fused away where cache_copy_target() allows). Other copies stay with ggml's CPU backend.
bool copy_is_ours(const ggml_tensor* cpy) {
  const ggml_tensor* from = cpy->src[0];
  if (from->op != GGML_OP_VIEW || from->view_src == nullptr || from->view_src->op != GGML_OP_GATED_DELTA_NET)
    return false;
  return kda_ggml::is_host_op(cpy) && kda_ggml::decline_reason(from->view_src).empty();
}

// ---- backend ---------------------------------------------------------------------------------

const char* backend_get_name(ggml_backend_t) { return kName; }

void backend_free(ggml_backend_t backend) {
  delete static_cast<BackendContext*>(backend->context);
  delete backend;
}

ggml_status backend_graph_compute(ggml_backend_t backend, ggml_cgraph* graph) {
  auto* ctx = static_cast<BackendContext*>(backend->context);
  kda::RunOptions options;
  options.num_threads = ctx->n_threads;
  options.context = &ctx->context;
  try {
    for (int i = 0; i < graph->n_nodes; ++i) {
      ggml_tensor* node = graph->nodes[i];
      if (is_view_or_noop(node)) continue;
      if (node->op == GGML_OP_GATED_DELTA_NET) {
        kda_ggml::StateTarget target;
        const int copy = fused_copy_index(graph, i, &target);
        log_first_node(node);
        kda_ggml::compute(node, options, target);
        if (copy >= 0) {
          log_fused_copy_once();
          i = copy;  // the states are in the cache already
        }
      } else if (!kda_ggml::compute_host_op(node)) {
        GGML_LOG_ERROR("%s: asked to compute %s, which it does not claim\n", "ggml-kda",
                       ggml_op_name(node->op));
        return GGML_STATUS_FAILED;
      }
    }
  } catch (const std::exception& e) {
    GGML_LOG_ERROR("%s: kda refused a node: %s\n", "ggml-kda", e.what());
    return GGML_STATUS_FAILED;
  }
  return GGML_STATUS_SUCCESS;
}

ggml_guid_t backend_guid() {
  static ggml_guid guid = {0x6b, 0x64, 0x61, 0x2d, 0x67, 0x67, 0x6d, 0x6c,
                           0x2d, 0x67, 0x64, 0x6e, 0x2d, 0x30, 0x30, 0x31};
  return &guid;
}

const ggml_backend_i kBackendInterface = {
    /* .get_name = */ backend_get_name,
    /* .free = */ backend_free,
    /* .set_tensor_async = */ nullptr,
    /* .get_tensor_async = */ nullptr,
    /* .set_tensor_2d_async = */ nullptr,
    /* .get_tensor_2d_async = */ nullptr,
    /* .cpy_tensor_async = */ nullptr,
    /* .synchronize = */ nullptr,
    /* .graph_plan_create = */ nullptr,
    /* .graph_plan_free = */ nullptr,
    /* .graph_plan_update = */ nullptr,
    /* .graph_plan_compute = */ nullptr,
    /* .graph_compute = */ backend_graph_compute,
    /* .event_record = */ nullptr,
    /* .event_wait = */ nullptr,
    /* .graph_optimize = */ nullptr,
};

void set_n_threads(ggml_backend_t backend, int n_threads) {
  if (n_threads < 1) {
    GGML_LOG_WARN("%s: thread count %d; using 1\n", "ggml-kda", n_threads);
    n_threads = 1;
  }
  static_cast<BackendContext*>(backend->context)->n_threads = n_threads;
}

// ---- device ----------------------------------------------------------------------------------

const char* device_get_name(ggml_backend_dev_t) { return kName; }

const char* device_get_description(ggml_backend_dev_t) {
  static const std::string description = std::string("kda ") + KDA_VERSION_STRING +
                                         ": GATED_DELTA_NET on the CPU (SIMD target " + kda::simd_target() +
                                         ")";
  return description.c_str();
}

void device_get_memory(ggml_backend_dev_t, size_t* free, size_t* total) {
  *free = 0;  // host memory, counted by the CPU device
  *total = 0;
}

enum ggml_backend_dev_type device_get_type(ggml_backend_dev_t) { return GGML_BACKEND_DEVICE_TYPE_ACCEL; }

void device_get_props(ggml_backend_dev_t dev, ggml_backend_dev_props* props) {
  props->name = device_get_name(dev);
  props->description = device_get_description(dev);
  props->type = device_get_type(dev);
  device_get_memory(dev, &props->memory_free, &props->memory_total);
  props->caps = {
      /* .async = */ false,
      /* .host_buffer = */ false,
      /* .buffer_from_host_ptr = */ true,
      /* .events = */ false,
      /* .mmap_support = */ true,
  };
}

ggml_backend_t device_init_backend(ggml_backend_dev_t dev, const char*) {
  return new ggml_backend{/* .guid = */ backend_guid(), /* .iface = */ kBackendInterface, /* .device = */ dev,
                          /* .context = */ new BackendContext};
}

ggml_backend_buffer_type_t device_get_buffer_type(ggml_backend_dev_t) {
  return ggml_backend_cpu_buffer_type();
}

ggml_backend_buffer_t device_buffer_from_host_ptr(ggml_backend_dev_t, void* ptr, size_t size, size_t) {
  return ggml_backend_cpu_buffer_from_ptr(ptr, size);
}

bool device_supports_op(ggml_backend_dev_t, const ggml_tensor* op) {
  switch (op->op) {
    case GGML_OP_NONE:
    case GGML_OP_RESHAPE:
    case GGML_OP_VIEW:
    case GGML_OP_PERMUTE:
    case GGML_OP_TRANSPOSE: return true;
    case GGML_OP_GATED_DELTA_NET: {
      const std::string why = kda_ggml::decline_reason(op);
      if (!why.empty()) log_decline_once(why);
      return why.empty();
    }
    case GGML_OP_CPY: return copy_is_ours(op);
    default: return kda_ggml::is_host_op(op);
  }
}

bool device_supports_buft(ggml_backend_dev_t, ggml_backend_buffer_type_t buft) {
  return ggml_backend_buft_is_host(buft);
}

const ggml_backend_device_i kDeviceInterface = {
    /* .get_name = */ device_get_name,
    /* .get_description = */ device_get_description,
    /* .get_memory = */ device_get_memory,
    /* .get_type = */ device_get_type,
    /* .get_props = */ device_get_props,
    /* .init_backend = */ device_init_backend,
    /* .get_buffer_type = */ device_get_buffer_type,
    /* .get_host_buffer_type = */ nullptr,
    /* .buffer_from_host_ptr = */ device_buffer_from_host_ptr,
    /* .supports_op = */ device_supports_op,
    /* .supports_buft = */ device_supports_buft,
    /* .offload_op = */ nullptr,
    /* .event_new = */ nullptr,
    /* .event_free = */ nullptr,
    /* .event_synchronize = */ nullptr,
};

// ---- registration ----------------------------------------------------------------------------

const char* reg_get_name(ggml_backend_reg_t) { return kName; }

size_t reg_get_device_count(ggml_backend_reg_t) { return 1; }

ggml_backend_dev_t reg_get_device(ggml_backend_reg_t reg, size_t index) {
  GGML_ASSERT(index == 0);
  static ggml_backend_device device = {/* .iface = */ kDeviceInterface, /* .reg = */ reg,
                                       /* .context = */ nullptr};
  return &device;
}

void* reg_get_proc_address(ggml_backend_reg_t, const char* name) {
  if (std::strcmp(name, "ggml_backend_set_n_threads") == 0) return reinterpret_cast<void*>(set_n_threads);
  return nullptr;
}

const ggml_backend_reg_i kRegInterface = {
    /* .get_name = */ reg_get_name,
    /* .get_device_count = */ reg_get_device_count,
    /* .get_device = */ reg_get_device,
    /* .get_proc_address = */ reg_get_proc_address,
};

ggml_backend_reg_t backend_reg() {
  static ggml_backend_reg reg = {/* .api_version = */ GGML_BACKEND_API_VERSION, /* .iface = */ kRegInterface,
                                 /* .context = */ nullptr};
  return &reg;
}

// 0 (ggml then logs that the backend is not supported here and loads nothing) when kda cannot run on
// this machine, e.g. a KDA_CPU_TARGET it lacks.
int backend_score() {
  try {
    (void)kda::simd_target();
    return 1;
  } catch (const std::exception& e) {
    GGML_LOG_ERROR("%s: kda cannot run here: %s\n", "ggml-kda", e.what());
    return 0;
  }
}

}  // namespace

GGML_BACKEND_DL_IMPL(backend_reg)
GGML_BACKEND_DL_SCORE_IMPL(backend_score)
