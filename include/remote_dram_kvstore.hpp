// remote_dram C++17 kvstore driver: TensorStore's kvstore contract (generations,
// conditional writes and deletes, byte ranges, key-range list and delete) over the C API in
// remote_dram.h. Header-only; needs nlohmann/json (Debian nlohmann-json3-dev).
//
// Threading: a KvStore owns `io_threads` I/O threads, each with its own rdram_client (a
// client is used by one thread at a time). Calls enqueue an operation and return a
// std::future at once; I/O threads take up to kBatch operations at a time and pipeline
// plain reads and writes through rdram_mget / rdram_mput, so many outstanding calls share
// round trips. A KvStore may be used from any number of threads.
#ifndef REMOTE_DRAM_KVSTORE_HPP
#define REMOTE_DRAM_KVSTORE_HPP

#include <remote_dram.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

namespace remote_dram {

// Status codes numbered like absl::StatusCode / TensorStore's.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;
  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
};

// A value or an error, like absl::StatusOr.
template <class T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit like StatusOr
  Result(Status status) : status_(std::move(status)) {}  // NOLINT
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() { return *value_; }
  const T& value() const { return *value_; }
  T* operator->() { return &*value_; }
  T& operator*() { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

// Maps a C status to the code TensorStore would use: the library's one table
// (rdram_status_grpc_code), which the gateway uses too. Outcomes that are not errors
// (OK, MISSING, UNCHANGED, CONDITION_FAILED) map to OK.
inline Status StatusFromC(rdram_status s, const std::string& context = "") {
  const StatusCode code = static_cast<StatusCode>(rdram_status_grpc_code(s));
  if (code == StatusCode::kOk) return {};
  std::string msg = rdram_strerror(s);
  const char* detail = rdram_last_error_message();
  if (detail && *detail) msg += std::string(": ") + detail;
  if (!context.empty()) msg = context + ": " + msg;
  return {code, msg};
}

// TensorStore's StorageGeneration: unknown (no condition / condition failed), no value
// (the key is absent), or a committed generation minted by the server.
struct StorageGeneration {
  enum class Kind { kUnknown, kNoValue, kValue };
  Kind kind = Kind::kUnknown;
  uint64_t value = 0;

  static StorageGeneration Unknown() { return {}; }
  static StorageGeneration NoValue() { return {Kind::kNoValue, 0}; }
  static StorageGeneration FromValue(uint64_t g) { return {Kind::kValue, g}; }
  bool IsUnknown() const { return kind == Kind::kUnknown; }
  bool IsNoValue() const { return kind == Kind::kNoValue; }
  friend bool operator==(const StorageGeneration& a, const StorageGeneration& b) {
    return a.kind == b.kind && a.value == b.value;
  }
  friend bool operator!=(const StorageGeneration& a, const StorageGeneration& b) { return !(a == b); }
};

struct TimestampedStorageGeneration {
  StorageGeneration generation;
  std::chrono::system_clock::time_point time;
};

// Bytes [inclusive_min, exclusive_max) of a value; a negative inclusive_min counts from
// the end (a suffix); no exclusive_max means "to the end".
struct ByteRange {
  int64_t inclusive_min = 0;
  std::optional<int64_t> exclusive_max;
};

struct ReadOptions {
  StorageGeneration if_equal;
  StorageGeneration if_not_equal;
  std::optional<ByteRange> byte_range;
  // Any value is current on a remote_dram server, so every staleness bound is met.
  std::chrono::system_clock::time_point staleness_bound = std::chrono::system_clock::now();
};

struct ReadResult {
  enum class State { kUnspecified, kMissing, kValue };
  State state = State::kUnspecified;
  std::string value;
  TimestampedStorageGeneration stamp;
  bool has_value() const { return state == State::kValue; }
};

struct WriteOptions {
  // Unknown: unconditional. NoValue: only if absent. Otherwise: only if equal.
  StorageGeneration if_equal;
};

// Keys k with inclusive_min <= k < exclusive_max; an empty exclusive_max is unbounded.
struct KeyRange {
  std::string inclusive_min;
  std::string exclusive_max;
  static KeyRange Prefix(const std::string& prefix) {
    std::string max = prefix;
    while (!max.empty() && static_cast<unsigned char>(max.back()) == 0xff) max.pop_back();
    if (!max.empty()) max.back() = static_cast<char>(static_cast<unsigned char>(max.back()) + 1);
    return {prefix, max};
  }
};

struct ListOptions {
  KeyRange range;
  size_t strip_prefix_length = 0;
};

struct ListEntry {
  std::string key;
  int64_t size = -1;
  friend bool operator==(const ListEntry& a, const ListEntry& b) { return a.key == b.key && a.size == b.size; }
};

template <class T>
using Future = std::future<Result<T>>;

class KvStore {
 public:
  static constexpr size_t kBatch = 64;

  // Opens a driver from its JSON spec:
  //   {"driver": "remote_dram", "remote_addr": "host:port" | ["a:1", "b:2"],
  //    "path": "prefix/", "auth_token": "...", "timeout_ms": 30000, "io_threads": 2}
  // or, hosting a server in this process ("server mode"), also a client of it:
  //   {"driver": "remote_dram", "listen_addr": "127.0.0.1:0", "memory": "1GiB", "workers": 2}
  static Result<std::shared_ptr<KvStore>> Open(const nlohmann::json& spec);

  ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  Future<ReadResult> Read(std::string key, ReadOptions options = {});
  // std::nullopt deletes. A failed condition yields an Unknown generation (not an error).
  Future<TimestampedStorageGeneration> Write(std::string key, std::optional<std::string> value,
                                             WriteOptions options = {});
  Future<TimestampedStorageGeneration> Delete(std::string key, WriteOptions options = {}) {
    return Write(std::move(key), std::nullopt, options);
  }
  Future<std::monostate> DeleteRange(KeyRange range);
  Future<std::vector<ListEntry>> List(ListOptions options);

  // Address of the embedded server in server mode, else empty.
  const std::string& server_address() const { return server_address_; }
  const std::string& path() const { return path_; }

 private:
  struct Op;
  KvStore() = default;
  void Enqueue(std::unique_ptr<Op> op);
  void IoLoop(rdram_client* client);
  void RunBatch(rdram_client* client, std::vector<std::unique_ptr<Op>>& ops);

  std::string path_;
  std::string server_address_;
  rdram_server* server_ = nullptr;
  std::vector<rdram_client*> clients_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  bool stopping_ = false;
};

// ---------------------------------------------------------------------------------------
// Implementation.

namespace internal {

inline const uint8_t* Bytes(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

inline bool PositiveInt(const nlohmann::json& j) { return j.is_number_integer() && j.get<int64_t>() > 0; }

inline Result<uint64_t> ParseSize(const nlohmann::json& j, const char* member) {
  if (PositiveInt(j)) return j.get<uint64_t>();
  if (!j.is_string()) return Status{StatusCode::kInvalidArgument, std::string("\"") + member + "\" must be a size like \"1GiB\" or a number of bytes"};
  std::string s = j.get<std::string>();
  size_t i = 0;
  while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) i++;
  if (i == 0) return Status{StatusCode::kInvalidArgument, std::string("\"") + member + "\": bad size \"" + s + "\""};
  uint64_t n = std::stoull(s.substr(0, i));
  std::string unit = s.substr(i);
  uint64_t mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KiB" || unit == "K") mult = 1ull << 10;
  else if (unit == "MiB" || unit == "M") mult = 1ull << 20;
  else if (unit == "GiB" || unit == "G") mult = 1ull << 30;
  else return Status{StatusCode::kInvalidArgument, std::string("\"") + member + "\": unknown unit \"" + unit + "\""};
  return n * mult;
}

inline TimestampedStorageGeneration Stamp(StorageGeneration g) { return {g, std::chrono::system_clock::now()}; }

}  // namespace internal

struct KvStore::Op {
  enum class Kind { kRead, kWrite, kDeleteRange, kList } kind;
  std::string key;
  ReadOptions read;
  std::optional<std::string> value;
  WriteOptions write;
  KeyRange range;
  size_t strip = 0;
  bool answered = false;  // set once a batch call answered it
  std::promise<Result<ReadResult>> read_done;
  std::promise<Result<TimestampedStorageGeneration>> write_done;
  std::promise<Result<std::monostate>> range_done;
  std::promise<Result<std::vector<ListEntry>>> list_done;

  bool PlainRead() const {
    return kind == Kind::kRead && read.if_equal.IsUnknown() && read.if_not_equal.IsUnknown() && !read.byte_range;
  }
  bool PlainWrite() const { return kind == Kind::kWrite && value && write.if_equal.IsUnknown() && key.size() <= 1024; }
};

inline Result<std::shared_ptr<KvStore>> KvStore::Open(const nlohmann::json& spec) {
  auto bad = [](const std::string& m) { return Status{StatusCode::kInvalidArgument, m}; };
  if (!spec.is_object()) return bad("kvstore spec must be a JSON object");
  static const char* kMembers[] = {"driver", "remote_addr", "listen_addr", "path", "auth_token", "timeout_ms",
                                   "io_threads", "memory", "workers", "cache_mode", "transport", "provider", "domains"};
  for (auto it = spec.begin(); it != spec.end(); ++it) {
    bool known = false;
    for (const char* m : kMembers) known |= it.key() == m;
    if (!known) return bad("unknown member \"" + it.key() + "\" in remote_dram spec");
  }
  if (!spec.contains("driver") || spec["driver"] != "remote_dram") return bad("\"driver\" must be \"remote_dram\"");
  bool client_mode = spec.contains("remote_addr"), server_mode = spec.contains("listen_addr");
  if (client_mode == server_mode) return bad("exactly one of \"remote_addr\" and \"listen_addr\" is required");
  std::shared_ptr<KvStore> store(new KvStore());
  std::string addresses;
  if (client_mode) {
    const auto& ra = spec["remote_addr"];
    if (ra.is_string()) {
      addresses = ra.get<std::string>();
    } else if (ra.is_array() && !ra.empty()) {
      for (const auto& a : ra) {
        if (!a.is_string()) return bad("\"remote_addr\" entries must be strings");
        addresses += (addresses.empty() ? "" : ",") + a.get<std::string>();
      }
    } else {
      return bad("\"remote_addr\" must be a \"host:port\" string or a non-empty list of them");
    }
  }
  if (!server_mode) {
    for (const char* m : {"memory", "workers", "cache_mode", "transport", "provider", "domains"})
      if (spec.contains(m)) return bad(std::string("\"") + m + "\" is only valid with \"listen_addr\"");
  }
  if (spec.contains("path")) {
    if (!spec["path"].is_string()) return bad("\"path\" must be a string");
    store->path_ = spec["path"].get<std::string>();
  }
  std::string token;
  if (spec.contains("auth_token")) {
    if (!spec["auth_token"].is_string()) return bad("\"auth_token\" must be a string");
    token = spec["auth_token"].get<std::string>();
  }
  uint32_t timeout_ms = 0;
  if (spec.contains("timeout_ms")) {
    if (!internal::PositiveInt(spec["timeout_ms"])) return bad("\"timeout_ms\" must be a positive integer");
    timeout_ms = spec["timeout_ms"].get<uint32_t>();
  }
  size_t io_threads = 2;
  if (spec.contains("io_threads")) {
    if (!internal::PositiveInt(spec["io_threads"]) || spec["io_threads"].get<size_t>() > 64)
      return bad("\"io_threads\" must be an integer from 1 to 64");
    io_threads = spec["io_threads"].get<size_t>();
  }
  if (server_mode) {
    if (!spec["listen_addr"].is_string()) return bad("\"listen_addr\" must be a \"host:port\" string");
    std::string listen = spec["listen_addr"].get<std::string>();
    rdram_server_config cfg{};
    cfg.listen_addr = listen.c_str();
    cfg.auth_token = token.empty() ? nullptr : token.c_str();
    if (spec.contains("memory")) {
      auto m = internal::ParseSize(spec["memory"], "memory");
      if (!m.ok()) return m.status();
      cfg.memory_bytes = *m;
    }
    if (spec.contains("workers")) {
      if (!internal::PositiveInt(spec["workers"])) return bad("\"workers\" must be a positive integer");
      cfg.workers = spec["workers"].get<uint32_t>();
    }
    if (spec.contains("cache_mode")) {
      if (!spec["cache_mode"].is_boolean()) return bad("\"cache_mode\" must be true or false");
      cfg.cache_mode = spec["cache_mode"].get<bool>();
    }
    // Clients need no transport setting: they follow what the server announces.
    std::string transport, provider;
    if (spec.contains("transport")) {
      if (!spec["transport"].is_string()) return bad("\"transport\" must be \"auto\", \"ucx\" or \"fabric\"");
      transport = spec["transport"].get<std::string>();
      cfg.transport = transport.c_str();
    }
    if (spec.contains("provider")) {
      if (!spec["provider"].is_string()) return bad("\"provider\" must be a libfabric provider name");
      provider = spec["provider"].get<std::string>();
      cfg.fabric_provider = provider.c_str();
    }
    if (spec.contains("domains")) {
      if (!internal::PositiveInt(spec["domains"]) || spec["domains"].get<uint32_t>() > 64)
        return bad("\"domains\" must be an integer from 1 to 64");
      cfg.fabric_domains = spec["domains"].get<uint32_t>();
    }
    rdram_status s = rdram_server_start(&cfg, &store->server_);
    if (s != RDRAM_OK) return StatusFromC(s, "starting the embedded server");
    store->server_address_ = rdram_server_address(store->server_);
    addresses = store->server_address_;
  }
  rdram_client_options opts{};
  opts.auth_token = token.empty() ? nullptr : token.c_str();
  opts.timeout_ms = timeout_ms;
  for (size_t i = 0; i < io_threads; i++) {
    rdram_client* c = nullptr;
    rdram_status s = rdram_client_connect(addresses.c_str(), &opts, &c);
    if (s != RDRAM_OK) return StatusFromC(s, "connecting to " + addresses);
    store->clients_.push_back(c);
  }
  for (rdram_client* c : store->clients_) store->threads_.emplace_back([s = store.get(), c] { s->IoLoop(c); });
  return store;
}

inline KvStore::~KvStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  for (rdram_client* c : clients_) rdram_client_close(c);
  rdram_server_stop(server_);
}

inline void KvStore::Enqueue(std::unique_ptr<Op> op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
}

inline Future<ReadResult> KvStore::Read(std::string key, ReadOptions options) {
  auto op = std::make_unique<Op>();
  op->kind = Op::Kind::kRead;
  op->key = path_ + key;
  op->read = options;
  auto f = op->read_done.get_future();
  Enqueue(std::move(op));
  return f;
}

inline Future<TimestampedStorageGeneration> KvStore::Write(std::string key, std::optional<std::string> value,
                                                           WriteOptions options) {
  auto op = std::make_unique<Op>();
  op->kind = Op::Kind::kWrite;
  op->key = path_ + key;
  op->value = std::move(value);
  op->write = options;
  auto f = op->write_done.get_future();
  Enqueue(std::move(op));
  return f;
}

inline Future<std::monostate> KvStore::DeleteRange(KeyRange range) {
  auto op = std::make_unique<Op>();
  op->kind = Op::Kind::kDeleteRange;
  op->range = {path_ + range.inclusive_min, range.exclusive_max.empty() ? KeyRange::Prefix(path_).exclusive_max : path_ + range.exclusive_max};
  auto f = op->range_done.get_future();
  Enqueue(std::move(op));
  return f;
}

inline Future<std::vector<ListEntry>> KvStore::List(ListOptions options) {
  auto op = std::make_unique<Op>();
  op->kind = Op::Kind::kList;
  op->range = {path_ + options.range.inclusive_min,
               options.range.exclusive_max.empty() ? KeyRange::Prefix(path_).exclusive_max : path_ + options.range.exclusive_max};
  op->strip = path_.size() + options.strip_prefix_length;
  auto f = op->list_done.get_future();
  Enqueue(std::move(op));
  return f;
}

inline void KvStore::IoLoop(rdram_client* client) {
  std::vector<std::unique_ptr<Op>> batch;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to do
      while (!queue_.empty() && batch.size() < kBatch) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    RunBatch(client, batch);
    batch.clear();
  }
}

namespace internal {

// Values are first read into an uninitialised guess of this size and copied out at their
// own size: a zero-filled 64 KiB string per read cost more than a small read itself.
constexpr size_t kReadGuess = 64 << 10;

// Reads one value. `size`: its size when the server has just reported it (a batched read
// whose guess was too small). Without it, a guess first; a larger value is then read
// straight into a string of the size the server reported (clearing it costs less than
// the second round trip saves; the copy out of a library-allocated buffer cost 4 MiB
// reads a quarter of their speed), and if it keeps changing size, into a buffer the
// library allocates.
inline Result<ReadResult> ReadOne(rdram_client* c, const std::string& key, const ReadOptions& o, std::optional<size_t> size = std::nullopt) {
  rdram_get_options go{};
  ReadResult r;
  if (o.if_equal.IsNoValue()) {
    // "Only if absent": a present value does not match.
    size_t len = 0;
    uint64_t gen = 0;
    rdram_status s = rdram_get_cond(c, Bytes(key), key.size(), nullptr, nullptr, 0, &len, &gen);
    if (s == RDRAM_MISSING) {
      r.state = ReadResult::State::kMissing;
      r.stamp = Stamp(StorageGeneration::NoValue());
      return r;
    }
    if (s != RDRAM_OK && s != RDRAM_BUFFER_TOO_SMALL) return StatusFromC(s, "read " + key);
    r.stamp = Stamp(StorageGeneration::Unknown());
    return r;
  }
  if (o.if_equal.kind == StorageGeneration::Kind::kValue) go.if_equal = o.if_equal.value;
  if (o.if_not_equal.kind == StorageGeneration::Kind::kValue) go.if_not_equal = o.if_not_equal.value;
  if (o.byte_range) {
    go.has_range = true;
    go.range_start = o.byte_range->inclusive_min;
    go.range_end = o.byte_range->exclusive_max.value_or(-1);
  }
  size_t len = 0;
  uint64_t gen = 0;
  rdram_status s = RDRAM_BUFFER_TOO_SMALL;
  if (!size) {
    std::unique_ptr<uint8_t[]> guess(new uint8_t[kReadGuess]);
    s = rdram_get_cond(c, Bytes(key), key.size(), &go, guess.get(), kReadGuess, &len, &gen);
    if (s == RDRAM_OK) r.value.assign(reinterpret_cast<const char*>(guess.get()), len);
    size = len;
  }
  for (int attempt = 0; attempt < 3 && s == RDRAM_BUFFER_TOO_SMALL; attempt++) {
    r.value.assign(*size, '\0');
    s = rdram_get_cond(c, Bytes(key), key.size(), &go, reinterpret_cast<uint8_t*>(&r.value[0]), r.value.size(), &len, &gen);
    size = len;  // RDRAM_BUFFER_TOO_SMALL: it changed size under us; ask again with the new one
  }
  if (s == RDRAM_OK) {
    r.value.resize(len);
  } else if (s == RDRAM_BUFFER_TOO_SMALL) {  // it keeps changing size: one round trip, sized by the library
    uint8_t* data = nullptr;
    s = rdram_get_cond_alloc(c, Bytes(key), key.size(), &go, &data, &len, &gen);
    if (s == RDRAM_OK) {
      r.value.assign(reinterpret_cast<const char*>(data), len);
      rdram_buf_free(data, len);
    }
  }
  switch (s) {
    case RDRAM_OK:
      r.state = ReadResult::State::kValue;
      r.stamp = Stamp(StorageGeneration::FromValue(gen));
      return r;
    case RDRAM_MISSING:
      r.value.clear();
      if (o.if_not_equal.IsNoValue()) {
        r.state = ReadResult::State::kUnspecified;
      } else {
        r.state = ReadResult::State::kMissing;
      }
      r.stamp = Stamp(StorageGeneration::NoValue());
      return r;
    case RDRAM_UNCHANGED:
      r.value.clear();
      r.stamp = Stamp(StorageGeneration::FromValue(gen));
      return r;
    default:
      return StatusFromC(s, "read " + key);
  }
}

inline Result<TimestampedStorageGeneration> WriteOne(rdram_client* c, const std::string& key, const std::optional<std::string>& value,
                                                     const WriteOptions& o) {
  if (!value) {
    uint64_t if_equal = o.if_equal.kind == StorageGeneration::Kind::kValue ? o.if_equal.value : 0;
    if (o.if_equal.IsNoValue()) {
      // Delete only if absent: succeeds when the key is absent, else the condition fails.
      size_t len = 0;
      rdram_status s = rdram_get(c, Bytes(key), key.size(), nullptr, 0, &len, nullptr);
      if (s == RDRAM_MISSING) return Stamp(StorageGeneration::NoValue());
      if (s == RDRAM_OK || s == RDRAM_BUFFER_TOO_SMALL) return Stamp(StorageGeneration::Unknown());
      return StatusFromC(s, "delete " + key);
    }
    rdram_status s = rdram_delete_cond(c, Bytes(key), key.size(), if_equal);
    if (s == RDRAM_OK) return Stamp(StorageGeneration::NoValue());
    if (s == RDRAM_MISSING) return Stamp(if_equal ? StorageGeneration::Unknown() : StorageGeneration::NoValue());
    if (s == RDRAM_CONDITION_FAILED) return Stamp(StorageGeneration::Unknown());
    return StatusFromC(s, "delete " + key);
  }
  rdram_put_options po{};
  po.if_absent = o.if_equal.IsNoValue();
  po.if_equal = o.if_equal.kind == StorageGeneration::Kind::kValue ? o.if_equal.value : 0;
  uint64_t gen = 0;
  rdram_status s = rdram_put_cond(c, Bytes(key), key.size(), Bytes(*value), value->size(), &po, &gen);
  if (s == RDRAM_OK) return Stamp(StorageGeneration::FromValue(gen));
  if (s == RDRAM_CONDITION_FAILED) return Stamp(StorageGeneration::Unknown());
  return StatusFromC(s, "write " + key);
}

}  // namespace internal

inline void KvStore::RunBatch(rdram_client* c, std::vector<std::unique_ptr<Op>>& ops) {
  // Plain writes and plain reads are pipelined through the batch calls.
  std::vector<Op*> writes, reads;
  for (auto& op : ops) {
    if (op->PlainWrite()) writes.push_back(op.get());
    else if (op->PlainRead() && op->key.size() <= 1024) reads.push_back(op.get());
  }
  if (writes.size() > 1) {
    std::vector<rdram_put_item> items(writes.size());
    for (size_t i = 0; i < writes.size(); i++) {
      items[i] = {internal::Bytes(writes[i]->key), writes[i]->key.size(), internal::Bytes(*writes[i]->value), writes[i]->value->size(), 0, RDRAM_INTERNAL};
    }
    rdram_mput(c, items.data(), items.size());
    for (size_t i = 0; i < writes.size(); i++) {
      if (items[i].status == RDRAM_OK) {
        writes[i]->write_done.set_value(internal::Stamp(StorageGeneration::FromValue(items[i].generation)));
      } else {
        writes[i]->write_done.set_value(StatusFromC(items[i].status, "write " + writes[i]->key));
      }
      writes[i]->answered = true;
    }
  }
  if (reads.size() > 1) {
    std::vector<std::unique_ptr<uint8_t[]>> bufs(reads.size());
    std::vector<rdram_get_item> items(reads.size());
    for (size_t i = 0; i < reads.size(); i++) {
      bufs[i].reset(new uint8_t[internal::kReadGuess]);
      items[i] = {internal::Bytes(reads[i]->key), reads[i]->key.size(), bufs[i].get(), internal::kReadGuess, 0, 0, RDRAM_INTERNAL};
    }
    rdram_mget(c, items.data(), items.size());
    for (size_t i = 0; i < reads.size(); i++) {
      Op* op = reads[i];
      if (items[i].status == RDRAM_OK) {
        ReadResult r;
        r.state = ReadResult::State::kValue;
        r.value.assign(reinterpret_cast<const char*>(bufs[i].get()), items[i].value_len);
        r.stamp = internal::Stamp(StorageGeneration::FromValue(items[i].generation));
        op->read_done.set_value(std::move(r));
      } else if (items[i].status == RDRAM_MISSING) {
        ReadResult r;
        r.state = ReadResult::State::kMissing;
        r.stamp = internal::Stamp(StorageGeneration::NoValue());
        op->read_done.set_value(std::move(r));
      } else if (items[i].status == RDRAM_BUFFER_TOO_SMALL) {
        op->read_done.set_value(internal::ReadOne(c, op->key, op->read, items[i].value_len));  // larger value: exact size
      } else {
        op->read_done.set_value(StatusFromC(items[i].status, "read " + op->key));
      }
      op->answered = true;
    }
  }
  for (auto& op : ops) {
    if (op->answered) continue;
    switch (op->kind) {
      case Op::Kind::kRead:
        op->read_done.set_value(internal::ReadOne(c, op->key, op->read));
        break;
      case Op::Kind::kWrite:
        op->write_done.set_value(internal::WriteOne(c, op->key, op->value, op->write));
        break;
      case Op::Kind::kDeleteRange: {
        const std::string& max = op->range.exclusive_max;
        rdram_status s = rdram_delete_range(c, internal::Bytes(op->range.inclusive_min), op->range.inclusive_min.size(),
                                            max.empty() ? nullptr : internal::Bytes(max), max.size(), nullptr);
        if (s == RDRAM_OK) op->range_done.set_value(std::monostate{});
        else op->range_done.set_value(StatusFromC(s, "delete range"));
        break;
      }
      case Op::Kind::kList: {
        struct Ctx { std::vector<ListEntry> out; size_t strip; } ctx{{}, op->strip};
        auto cb = [](void* ud, const uint8_t* key, size_t len, uint64_t size) -> int32_t {
          auto* x = static_cast<Ctx*>(ud);
          size_t cut = x->strip < len ? x->strip : len;
          x->out.push_back({std::string(reinterpret_cast<const char*>(key) + cut, len - cut), static_cast<int64_t>(size)});
          return 0;
        };
        const std::string& max = op->range.exclusive_max;
        rdram_status s = rdram_list(c, internal::Bytes(op->range.inclusive_min), op->range.inclusive_min.size(),
                                    max.empty() ? nullptr : internal::Bytes(max), max.size(), cb, &ctx);
        if (s == RDRAM_OK) op->list_done.set_value(std::move(ctx.out));
        else op->list_done.set_value(StatusFromC(s, "list"));
        break;
      }
    }
  }
}

}  // namespace remote_dram

#endif  // REMOTE_DRAM_KVSTORE_HPP
