#include "io/queue.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace statestore {
namespace io {

namespace {

constexpr int kMaxRetries = 64;

std::string op_name(Op op) { return op == Op::Read ? "read" : "write"; }

std::string describe(Op op, const std::string& path, int64_t nbytes, int64_t offset) {
  return op_name(op) + " of " + std::to_string(nbytes) + " bytes at offset " +
         std::to_string(offset) + " in '" + path + "'";
}

}  // namespace

Queue::Queue(const std::string& engine, int depth, int64_t block_size, int nthreads)
    : engine_(engine), depth_(depth), block_size_(block_size) {
  if (depth < 1 || depth > 4096)
    throw std::invalid_argument("queue_depth must be in [1, 4096], got " + std::to_string(depth));
  if (block_size < 4096 || block_size % 4096 != 0 || block_size > (int64_t(1) << 30))
    throw std::invalid_argument("block_size must be a multiple of 4096 in [4096, 1 GiB], got " +
                                std::to_string(block_size));
  if (engine == "io_uring") {
    backend_ = make_uring_backend(depth);
  } else if (engine == "libaio") {
    backend_ = make_aio_backend(depth);
  } else if (engine == "threads") {
    if (nthreads < 1 || nthreads > 256)
      throw std::invalid_argument("threads must be in [1, 256], got " + std::to_string(nthreads));
    backend_ = make_threads_backend(depth, nthreads);
  } else {
    throw std::invalid_argument("engine must be 'io_uring', 'libaio' or 'threads', got '" + engine + "'");
  }
  slots_.resize(static_cast<size_t>(depth));
  free_slots_.reserve(static_cast<size_t>(depth));
  for (int i = depth - 1; i >= 0; --i) free_slots_.push_back(i);
  reaper_ = std::thread([this] { reaper_loop(); });
  // Named (before the constructor returns), so that statestore's threads are recognisable
  // (top -H, gdb, /proc/<pid>/task/*/comm; tests/reliability/test_faults.py checks none outlives close()).
  ::pthread_setname_np(reaper_.native_handle(), "ss-io-reaper");
}

Queue::~Queue() {
  try {
    close();
  } catch (...) {
    // Destructors never throw; close() only fails when the engine itself broke.
  }
}

uint64_t Queue::submit(Op op, int fd, char* buf, int64_t nbytes, int64_t offset,
                       const std::string& path, int flags) {
  if (fd < 0) throw std::invalid_argument("fd must be >= 0, got " + std::to_string(fd) + " for '" + path + "'");
  if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0, got " + std::to_string(nbytes));
  if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
  if (buf == nullptr && nbytes > 0) throw std::invalid_argument("buffer must not be null");
  std::vector<uint64_t> finished;
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closing_) throw std::runtime_error("I/O engine is closed");
    id = next_id_++;
    Request rq;
    rq.op = op;
    rq.fd = fd;
    rq.flags = flags;
    rq.nbytes = nbytes;
    rq.offset = offset;
    rq.path = path;
    ++stats_.requests;
    for (int64_t done = 0; done < nbytes; done += block_size_) {
      int64_t n = std::min(block_size_, nbytes - done);
      pending_.push_back(Piece{id, buf + done, n, offset + done, 0});
      ++rq.outstanding_blocks;
    }
    reqs_.emplace(id, std::move(rq));
    if (nbytes == 0) finished.push_back(id);
    else pump_locked();
  }
  for (uint64_t f : finished) finish(f);
  return id;
}

void Queue::pump_locked() {
  if (pending_.empty() || free_slots_.empty()) return;
  std::vector<Block> batch;
  batch.reserve(std::min(pending_.size(), free_slots_.size()));
  while (!pending_.empty() && !free_slots_.empty()) {
    Piece p = pending_.front();
    pending_.pop_front();
    auto it = reqs_.find(p.req);
    Request& rq = it->second;
    if (rq.err != 0) {  // a failed request submits nothing more
      --rq.outstanding_blocks;
      if (rq.outstanding_blocks == 0) {
        // Completed by a later finish() call from the reaper; queue it now.
        completed_.push_back(Completion{p.req, rq.done_bytes, rq.err, rq.message});
        reqs_.erase(it);
        done_cv_.notify_all();
        idle_cv_.notify_all();
      }
      continue;
    }
    int slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[static_cast<size_t>(slot)] = p;
    batch.push_back(Block{static_cast<uint64_t>(slot), rq.fd, rq.op, p.buf,
                          static_cast<size_t>(p.nbytes), p.offset});
  }
  if (batch.empty()) return;
  int accepted = 0;
  int err = 0;
  std::string what;
  try {
    accepted = backend_->submit(batch.data(), static_cast<int>(batch.size()));
  } catch (const std::system_error& e) {
    err = e.code().value();
    what = e.what();
    what = what.substr(0, what.find(':'));  // the call's name; fail_locked adds strerror
  }
  // Give back what the engine did not take: in order, at the front of the queue.
  for (size_t i = batch.size(); i-- > static_cast<size_t>(accepted);) {
    int slot = static_cast<int>(batch[i].tag);
    Piece p = slots_[static_cast<size_t>(slot)];
    free_slots_.push_back(slot);
    if (err != 0) {
      Request& rq = reqs_.at(p.req);
      fail_locked(rq, err, describe(rq.op, rq.path, p.nbytes, p.offset) + " failed in " + what);
    }
    pending_.push_front(p);
  }
  if (accepted > 0) stats_.blocks += static_cast<uint64_t>(accepted);
  if (err != 0) pump_locked();  // drops the failed pieces
}

void Queue::fail_locked(Request& rq, int err, const std::string& what) {
  if (rq.err != 0) return;
  rq.err = err;
  rq.message = what + ": " + std::strerror(err);
  ++stats_.errors;
}

int64_t Queue::apply_fault_locked(const Piece& p, Op op, int64_t res) {
  if (!fault_.armed || res < 0) return res;
  if (fault_.op >= 0 && fault_.op != static_cast<int>(op)) return res;
  if (fault_.skip > 0) {
    --fault_.skip;
    return res;
  }
  if (fault_.count <= 0) return res;
  // Short transfer: half the block, rounded down to 512 bytes, as a direct transfer can be
  // short (the retry of the rest must stay valid for O_DIRECT). A block of 512 bytes or
  // less cannot be cut that way: it completes whole and does not count.
  int64_t s = (p.nbytes / 2) & ~int64_t(511);
  if (fault_.kind == 1 && s == 0) return res;
  if (--fault_.count == 0) fault_.armed = false;
  if (fault_.kind == 0) return -static_cast<int64_t>(fault_.err);
  return std::min(res, s);
}

void Queue::on_block_locked(const BlockResult& r, std::vector<uint64_t>& finished) {
  if (r.tag >= slots_.size()) return;  // cannot happen; never index out of range
  int slot = static_cast<int>(r.tag);
  Piece p = slots_[static_cast<size_t>(slot)];
  free_slots_.push_back(slot);
  auto it = reqs_.find(p.req);
  if (it == reqs_.end()) return;
  Request& rq = it->second;
  int64_t res = apply_fault_locked(p, rq.op, r.res);
  bool requeued = false;
  if (rq.err == 0) {
    if (res < 0) {
      int e = static_cast<int>(-res);
      if ((e == EAGAIN || e == EINTR) && p.retries < kMaxRetries) {
        ++p.retries;
        ++stats_.retries;
        pending_.push_front(p);
        requeued = true;
      } else {
        fail_locked(rq, e, describe(rq.op, rq.path, p.nbytes, p.offset) + " failed");
      }
    } else if (res < p.nbytes) {
      bool eof = false;
      if (rq.op == Op::Read) {
        struct stat st;
        if (::fstat(rq.fd, &st) == 0 && p.offset + res >= static_cast<int64_t>(st.st_size)) eof = true;
      }
      if (eof) {
        rq.done_bytes += res;
        rq.err = ENODATA;
        rq.message = "short read of '" + rq.path + "': wanted " + std::to_string(rq.nbytes) +
                     " bytes at offset " + std::to_string(rq.offset) + ", the file ends at offset " +
                     std::to_string(p.offset + res) + " (end of file)";
        ++stats_.errors;
      } else if (res == 0 || p.retries >= kMaxRetries) {
        fail_locked(rq, EIO, describe(rq.op, rq.path, p.nbytes, p.offset) + " made no progress (" +
                                 std::to_string(res) + " bytes transferred)");
      } else {
        rq.done_bytes += res;
        (rq.op == Op::Read ? stats_.bytes_read : stats_.bytes_written) += static_cast<uint64_t>(res);
        p.buf += res;
        p.offset += res;
        p.nbytes -= res;
        ++p.retries;
        ++stats_.retries;
        pending_.push_front(p);
        requeued = true;
      }
    } else {
      rq.done_bytes += res;
      (rq.op == Op::Read ? stats_.bytes_read : stats_.bytes_written) += static_cast<uint64_t>(res);
    }
  }
  if (!requeued && --rq.outstanding_blocks == 0) finished.push_back(p.req);
}

void Queue::finish(uint64_t id) {
  // Post-processing outside the lock (may block on writeback), then publish the completion.
  Request rq;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = reqs_.find(id);
    if (it == reqs_.end()) return;
    rq = it->second;  // a copy: the entry stays until published below
  }
  if (rq.err == 0 && rq.nbytes > 0) {
    if (rq.op == Op::Write && (rq.flags & kDropCache)) {
      if (::sync_file_range(rq.fd, rq.offset, rq.nbytes,
                            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
        int e = errno;
        rq.err = e;
        rq.message = "writing back " + describe(rq.op, rq.path, rq.nbytes, rq.offset) + " failed: " + std::strerror(e);
      }
    }
    if (rq.err == 0 && rq.op == Op::Write && (rq.flags & kDataSync)) {
      if (::fdatasync(rq.fd) != 0) {
        int e = errno;
        rq.err = e;
        rq.message = "fdatasync of '" + rq.path + "' failed: " + std::string(std::strerror(e));
      }
    }
    if (rq.err == 0 && (rq.flags & kDropCache)) {
      int e = ::posix_fadvise(rq.fd, rq.offset, rq.nbytes, POSIX_FADV_DONTNEED);
      if (e != 0) {
        rq.err = e;
        rq.message = "posix_fadvise(DONTNEED) on '" + rq.path + "' failed: " + std::string(std::strerror(e));
      }
    }
  }
  std::lock_guard<std::mutex> g(mu_);
  if (rq.err != 0 && reqs_.at(id).err == 0) ++stats_.errors;  // failed in post-processing
  completed_.push_back(Completion{id, rq.done_bytes, rq.err, rq.message});
  reqs_.erase(id);
  done_cv_.notify_all();
  idle_cv_.notify_all();
}

void Queue::reaper_loop() {
  std::vector<BlockResult> results(static_cast<size_t>(depth_));
  std::vector<uint64_t> finished;
  for (;;) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stop_reaper_) return;
    }
    int n = 0;
    int err = 0;
    std::string what;
    try {
      n = backend_->reap(results.data(), depth_, 50);
    } catch (const std::system_error& e) {
      err = e.code().value();
      what = e.what();
      what = what.substr(0, what.find(':'));
    }
    finished.clear();
    {
      std::lock_guard<std::mutex> g(mu_);
      for (int i = 0; i < n; ++i) on_block_locked(results[static_cast<size_t>(i)], finished);
      if (err != 0) {
        // The engine itself failed: fail everything still pending; in-flight blocks are lost
        // to the kernel, so their requests fail too.
        for (auto& kv : reqs_)
          fail_locked(kv.second, err, "I/O on '" + kv.second.path + "' failed: engine " + engine_ + " broke in " + what);
      }
      try {
        backend_->flush();
      } catch (const std::system_error& e) {
        std::string w = e.what();
        w = w.substr(0, w.find(':'));
        for (auto& kv : reqs_)
          fail_locked(kv.second, e.code().value(), "I/O on '" + kv.second.path + "' failed in " + w);
      }
      pump_locked();
    }
    for (uint64_t id : finished) finish(id);
  }
}

std::vector<Completion> Queue::wait(int min_n, int max_n, int timeout_ms) {
  std::unique_lock<std::mutex> g(mu_);
  auto ready = [&] { return static_cast<int>(completed_.size()) >= min_n || closed_; };
  if (timeout_ms < 0) done_cv_.wait(g, ready);
  else done_cv_.wait_for(g, std::chrono::milliseconds(timeout_ms), ready);
  std::vector<Completion> out;
  while (!completed_.empty() && static_cast<int>(out.size()) < max_n) {
    out.push_back(std::move(completed_.front()));
    completed_.pop_front();
  }
  return out;
}

void Queue::close() {
  {
    std::unique_lock<std::mutex> g(mu_);
    if (closed_) return;
    closing_ = true;
    idle_cv_.wait(g, [this] { return reqs_.empty(); });
    stop_reaper_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
  backend_.reset();
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
  done_cv_.notify_all();
}

void Queue::inject_fault(int op, int skip, int count, int kind, int err) {
  if (op < -1 || op > 1) throw std::invalid_argument("op must be -1 (any), 0 (read) or 1 (write)");
  if (skip < 0 || count < 0) throw std::invalid_argument("skip and count must be >= 0");
  if (kind != 0 && kind != 1) throw std::invalid_argument("kind must be 0 (error) or 1 (short)");
  if (kind == 0 && err <= 0) throw std::invalid_argument("err must be a positive errno value");
  std::lock_guard<std::mutex> g(mu_);
  fault_.armed = count > 0;
  fault_.op = op;
  fault_.skip = skip;
  fault_.count = count;
  fault_.kind = kind;
  fault_.err = err;
}

void Queue::clear_faults() {
  std::lock_guard<std::mutex> g(mu_);
  fault_ = Fault{};
}

QueueStats Queue::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

size_t Queue::outstanding() const {
  std::lock_guard<std::mutex> g(mu_);
  return reqs_.size();
}

bool Queue::closed() const {
  std::lock_guard<std::mutex> g(mu_);
  return closed_;
}

}  // namespace io
}  // namespace statestore
