// Shared-memory all-reduce and all-gather between the tensor-parallel ranks of one host
// (engine/executor/shm_collectives.py): the hot path of the TP layers on CPU, instead of gloo
// over loopback TCP. An extension module of its own (engine/kernels/shm_comm.py builds it).
//
// Segment (one file, mapped by every rank): a 4096-byte header with one cache line per rank
// {seq: the last round this rank's slot is complete for, pid}, then 2 x world slots of
// slot_bytes: slot(parity, rank). Round c (every collective is one round or more; all ranks
// run the same rounds in the same order): copy this rank's part into slot(c & 1, rank),
// store seq = c (release), wait until every peer's seq >= c (acquire), then read every
// rank's slot. Two parities make a second barrier unnecessary: a rank writes slot(c & 1)
// again in round c + 2 only after it saw every peer reach round c + 1, which a peer does only
// after it has finished reading round c.
//
// The sum runs in rank order on every rank (bf16: in float32, rounded once), so every rank
// holds the identical result. The wait spins briefly (~tens of microseconds: the usual skew
// between two ranks on two cores), then sleeps on a futex in the peer's line (`word`, the low
// 32 bits of its seq) until the peer's arrival wakes it: a waiting rank takes no core from its
// peer or anyone else (a sched_yield loop kept it runnable, and 50 us sleeps made it late).
// An arriving rank calls FUTEX_WAKE only when its line counts a sleeper (`sleepers`; the
// seq_cst store of `word` and load of `sleepers` against the sleeper's increment and load of
// `word` make a lost wake-up impossible). The sleep ends every 10 ms to look at the peer: the
// wait raises when a peer process is gone or the deadline passes, never waits forever.
#include <torch/extension.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define PDSERVE_PAUSE() _mm_pause()
#else
#define PDSERVE_PAUSE() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace {

constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kMaxWorld = 32;  // header lines: 1 + kMaxWorld lines of 64 bytes fit
constexpr int kSpins = 2000;        // ~tens of microseconds of pause before sleeping
constexpr double kCheckS = 0.01;    // how often a sleeping rank looks at its peers' pids

struct alignas(64) RankLine {
  std::atomic<uint64_t> seq;
  std::atomic<int64_t> pid;
  std::atomic<uint32_t> word;      // the futex: low 32 bits of seq, stored after it
  std::atomic<uint32_t> sleepers;  // peers asleep on `word`
};
static_assert(sizeof(std::atomic<uint32_t>) == 4, "a futex word is 4 bytes");

// The segment is MAP_SHARED between processes: shared (not private) futex operations.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, double timeout_s) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_s);
  ts.tv_nsec = static_cast<long>((timeout_s - ts.tv_sec) * 1e9);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr,
          nullptr, 0);
}

// Counts this rank among a line's sleepers while it lives (also when the wait raises).
class Sleeping {
 public:
  explicit Sleeping(RankLine* l) : l_(l) { l_->sleepers.fetch_add(1, std::memory_order_seq_cst); }
  ~Sleeping() { l_->sleepers.fetch_sub(1, std::memory_order_seq_cst); }
  Sleeping(const Sleeping&) = delete;
  Sleeping& operator=(const Sleeping&) = delete;

 private:
  RankLine* l_;
};

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A process that exited (gone, or a zombie its parent has not reaped yet).
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  char state = line[close + 2];
  return state == 'Z' || state == 'X';
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as c10::BFloat16 does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

class ShmComm {
 public:
  ShmComm(const std::string& path, int64_t rank, int64_t world, int64_t slot_bytes,
          double timeout_s)
      : rank_(rank), world_(world), slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
    TORCH_CHECK(world >= 1 && world <= kMaxWorld, "shm_comm: world size ", world,
                " out of range 1..", kMaxWorld);
    TORCH_CHECK(rank >= 0 && rank < world, "shm_comm: rank ", rank, " of ", world);
    TORCH_CHECK(slot_bytes > 0 && slot_bytes % 4096 == 0,
                "shm_comm: slot_bytes must be a positive multiple of 4096, got ", slot_bytes);
    size_ = kHeaderBytes + 2 * world * slot_bytes;
    int fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    TORCH_CHECK(fd >= 0, "shm_comm: cannot open ", path, ": ", std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size < size_) {
      close(fd);
      TORCH_CHECK(false, "shm_comm: ", path, " is smaller than the ", size_, " bytes expected");
    }
    void* base = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    TORCH_CHECK(base != MAP_FAILED, "shm_comm: mmap of ", path, ": ", std::strerror(errno));
    base_ = static_cast<char*>(base);
    line(rank_)->pid.store(getpid(), std::memory_order_release);
    seq_ = line(rank_)->seq.load(std::memory_order_acquire);
  }

  ~ShmComm() {
    if (base_ != nullptr) munmap(base_, size_);
  }

  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  // Sum of x over the ranks, into x (float32 or bfloat16, contiguous).
  void all_reduce(torch::Tensor x) {
    check_input(x);
    const int64_t elem = x.element_size();
    const int64_t per_round = slot_bytes_ / elem;
    const int64_t n = x.numel();
    char* data = static_cast<char*>(x.data_ptr());
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    for (int64_t off = 0; off < n; off += per_round) {
      const int64_t cnt = std::min(per_round, n - off);
      const int64_t c = arrive(data + off * elem, cnt * elem);
      if (bf16)
        sum_bf16(c, reinterpret_cast<uint16_t*>(data) + off, cnt);
      else
        sum_f32(c, reinterpret_cast<float*>(data) + off, cnt);
    }
  }

  // x [N, k] on every rank -> [N, world * k]: the ranks' x side by side, in rank order.
  torch::Tensor all_gather(torch::Tensor x) {
    check_input(x);
    TORCH_CHECK(x.dim() == 2, "shm_comm.all_gather: expected a 2-d tensor, got ", x.dim(), "-d");
    const int64_t rows = x.size(0), row_bytes = x.size(1) * x.element_size();
    TORCH_CHECK(row_bytes <= slot_bytes_, "shm_comm.all_gather: a row of ", row_bytes,
                " bytes exceeds the slot (", slot_bytes_, ")");
    auto out = torch::empty({rows, world_ * x.size(1)}, x.options());
    const int64_t per_round = std::max<int64_t>(1, slot_bytes_ / std::max<int64_t>(1, row_bytes));
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t r0 = 0; r0 < rows; r0 += per_round) {
      const int64_t cnt = std::min(per_round, rows - r0);
      const int64_t c = arrive(src + r0 * row_bytes, cnt * row_bytes);
      for (int64_t j = 0; j < world_; ++j) {
        const char* part = slot(c, j);
        for (int64_t i = 0; i < cnt; ++i)
          std::memcpy(dst + ((r0 + i) * world_ + j) * row_bytes, part + i * row_bytes,
                      row_bytes);
      }
    }
    return out;
  }

  int64_t seq() const { return static_cast<int64_t>(seq_); }

 private:
  RankLine* line(int64_t r) const {
    return reinterpret_cast<RankLine*>(base_ + 64 * (1 + r));
  }

  char* slot(uint64_t c, int64_t r) const {
    return base_ + kHeaderBytes + ((static_cast<int64_t>(c & 1) * world_) + r) * slot_bytes_;
  }

  void check_input(const torch::Tensor& x) const {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(),
                "shm_comm: expected a contiguous CPU tensor");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "shm_comm: float32 or bfloat16 only, got ", x.scalar_type());
  }

  // One round: publish `bytes` of `src` in this rank's slot, wait for every peer's.
  uint64_t arrive(const char* src, int64_t bytes) {
    const uint64_t c = ++seq_;
    if (bytes > 0) std::memcpy(slot(c, rank_), src, bytes);
    RankLine* mine = line(rank_);
    mine->seq.store(c, std::memory_order_release);
    mine->word.store(static_cast<uint32_t>(c), std::memory_order_seq_cst);
    if (mine->sleepers.load(std::memory_order_seq_cst) > 0) futex_wake(&mine->word);
    for (int64_t j = 0; j < world_; ++j)
      if (j != rank_) wait_for(j, c);
    return c;
  }

  void wait_for(int64_t peer, uint64_t c) {
    RankLine* l = line(peer);
    for (int i = 0; i < kSpins; ++i) {
      if (l->seq.load(std::memory_order_acquire) >= c) return;
      PDSERVE_PAUSE();
    }
    const auto t0 = Clock::now();
    double next_check = kCheckS;
    Sleeping sleeping(l);
    while (true) {
      const uint32_t word = l->word.load(std::memory_order_seq_cst);
      if (l->seq.load(std::memory_order_acquire) >= c) return;
      futex_wait(&l->word, word, kCheckS);  // until the peer stores a new word, or 10 ms
      if (l->seq.load(std::memory_order_acquire) >= c) return;
      const double waited = seconds_since(t0);
      if (waited >= next_check) {
        next_check = waited + kCheckS;
        const int64_t pid = l->pid.load(std::memory_order_acquire);
        TORCH_CHECK(!process_gone(pid), "shm_comm: tensor-parallel rank ", peer, " (pid ", pid,
                    ") is gone; rank ", rank_, " cannot complete collective round ", c);
        TORCH_CHECK(waited <= timeout_s_, "shm_comm: tensor-parallel rank ", peer, " (pid ",
                    pid, ") did not reach collective round ", c, " within ", timeout_s_,
                    "s; rank ", rank_, " gives up");
      }
    }
  }

  void sum_f32(uint64_t c, float* out, int64_t n) const {
    const float* s0 = reinterpret_cast<const float*>(slot(c, 0));
    if (world_ == 2) {
      const float* s1 = reinterpret_cast<const float*>(slot(c, 1));
      for (int64_t i = 0; i < n; ++i) out[i] = s0[i] + s1[i];
      return;
    }
    std::memcpy(out, s0, n * sizeof(float));
    for (int64_t j = 1; j < world_; ++j) {
      const float* s = reinterpret_cast<const float*>(slot(c, j));
      for (int64_t i = 0; i < n; ++i) out[i] += s[i];
    }
  }

  void sum_bf16(uint64_t c, uint16_t* out, int64_t n) const {
    constexpr int64_t kBlock = 1024;
    float acc[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t m = std::min(kBlock, n - b);
      const uint16_t* s0 = reinterpret_cast<const uint16_t*>(slot(c, 0)) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] = bf16_to_f32(s0[i]);
      for (int64_t j = 1; j < world_; ++j) {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(slot(c, j)) + b;
        for (int64_t i = 0; i < m; ++i) acc[i] += bf16_to_f32(s[i]);
      }
      for (int64_t i = 0; i < m; ++i) out[b + i] = f32_to_bf16(acc[i]);
    }
  }

  int64_t rank_, world_, slot_bytes_;
  double timeout_s_;
  int64_t size_ = 0;
  char* base_ = nullptr;
  uint64_t seq_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<ShmComm>(m, "ShmComm",
                      "shared-memory all-reduce / all-gather between the TP ranks of one host")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, double>(), py::arg("path"),
           py::arg("rank"), py::arg("world"), py::arg("slot_bytes"), py::arg("timeout_s"))
      .def("all_reduce", &ShmComm::all_reduce, "sum over the ranks, in place",
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &ShmComm::all_gather, "[N, k] -> [N, world*k], rank order",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("seq", &ShmComm::seq);
}
