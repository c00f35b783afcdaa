// Conformance of the C++ kvstore driver: runs the shared case list
// (tests/conformance/cases.json) against a real server, plus spec parsing and server mode.
// env: RDRAM_SERVER (address of a running server), RDRAM_CONFORMANCE_CASES (cases.json).
#include <gtest/gtest.h>
#include <remote_dram_kvstore.hpp>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>

using namespace remote_dram;
using json = nlohmann::json;

namespace {

std::string Server() {
  const char* s = std::getenv("RDRAM_SERVER");
  return s ? s : "";
}

json LoadCases() {
  const char* path = std::getenv("RDRAM_CONFORMANCE_CASES");
  std::ifstream in(path ? path : "");
  if (!in) return json::array();
  return json::parse(in)["cases"];
}

// Pattern bytes shared by every runner: byte i is (i * 31 + seed * 7) mod 256.
std::string Value(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  size_t size = v["size"], seed = v["seed"], from = v.value("from", size_t{0});
  std::string out(size - from, '\0');
  for (size_t i = from; i < size; i++) out[i - from] = static_cast<char>((i * 31 + seed * 7) & 0xff);
  return out;
}

struct Runner {
  std::shared_ptr<KvStore> store;
  std::map<std::string, StorageGeneration> saved;

  StorageGeneration Gen(const json& ref) {
    std::string r = ref.get<std::string>();
    if (r == "no_value") return StorageGeneration::NoValue();
    if (r == "bogus") return StorageGeneration::FromValue(12345);
    EXPECT_EQ(r[0], '$') << r;
    EXPECT_TRUE(saved.count(r.substr(1))) << "no saved generation " << r;
    return saved[r.substr(1)];
  }

  void Step(const json& s) {
    std::string op = s["op"];
    SCOPED_TRACE(s.dump());
    std::string expect = s.value("expect", "");
    if (op == "write" || op == "delete") {
      WriteOptions wo;
      if (s.contains("if_equal")) wo.if_equal = Gen(s["if_equal"]);
      auto f = op == "write" ? store->Write(s["key"], Value(s["value"]), wo) : store->Delete(s["key"], wo);
      auto r = f.get();
      ASSERT_TRUE(r.ok()) << r.status().message;
      if (expect == "condition_failed") {
        EXPECT_TRUE(r->generation.IsUnknown());
      } else if (op == "delete") {
        EXPECT_TRUE(r->generation.IsNoValue());
      } else {
        EXPECT_EQ(r->generation.kind, StorageGeneration::Kind::kValue);
      }
      if (s.contains("save")) saved[s["save"]] = r->generation;
    } else if (op == "read") {
      ReadOptions ro;
      if (s.contains("if_equal")) ro.if_equal = Gen(s["if_equal"]);
      if (s.contains("if_not_equal")) ro.if_not_equal = Gen(s["if_not_equal"]);
      if (s.contains("range")) {
        ByteRange br;
        br.inclusive_min = s["range"][0];
        if (!s["range"][1].is_null()) br.exclusive_max = s["range"][1].get<int64_t>();
        ro.byte_range = br;
      }
      auto r = store->Read(s["key"], ro).get();
      if (expect.rfind("error:", 0) == 0) {
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(expect, "error:OUT_OF_RANGE");
        EXPECT_EQ(r.status().code, StatusCode::kOutOfRange) << r.status().message;
        return;
      }
      ASSERT_TRUE(r.ok()) << r.status().message;
      auto want_state = expect == "value" ? ReadResult::State::kValue
                        : expect == "missing" ? ReadResult::State::kMissing
                                              : ReadResult::State::kUnspecified;
      EXPECT_EQ(static_cast<int>(r->state), static_cast<int>(want_state));
      if (s.contains("value")) {
        EXPECT_TRUE(r->value == Value(s["value"])) << "value differs";
      }
      if (s.contains("generation")) {
        EXPECT_TRUE(r->stamp.generation == Gen(s["generation"]));
      }
    } else if (op == "list") {
      ListOptions lo;
      if (s.contains("range")) lo.range = {s["range"][0], s["range"][1]};
      lo.strip_prefix_length = s.value("strip", size_t{0});
      auto r = store->List(lo).get();
      ASSERT_TRUE(r.ok()) << r.status().message;
      std::vector<std::string> keys;
      std::vector<int64_t> sizes;
      for (auto& e : *r) {
        keys.push_back(e.key);
        sizes.push_back(e.size);
      }
      EXPECT_EQ(keys, s["expect_keys"].get<std::vector<std::string>>());
      if (s.contains("expect_sizes")) {
        EXPECT_EQ(sizes, s["expect_sizes"].get<std::vector<int64_t>>());
      }
    } else if (op == "delete_range") {
      auto r = store->DeleteRange({s["range"][0], s["range"][1]}).get();
      ASSERT_TRUE(r.ok()) << r.status().message;
    } else if (op == "generations_differ") {
      EXPECT_TRUE(saved.at(s["a"]) != saved.at(s["b"]));
    } else if (op == "concurrent_writes") {
      int n = s["count"];
      std::vector<Future<TimestampedStorageGeneration>> writes;
      for (int i = 0; i < n; i++) writes.push_back(store->Write("k" + std::to_string(i), "v" + std::to_string(i)));
      for (auto& f : writes) ASSERT_TRUE(f.get().ok());
      std::vector<Future<ReadResult>> reads;
      for (int i = 0; i < n; i++) reads.push_back(store->Read("k" + std::to_string(i)));
      for (int i = 0; i < n; i++) {
        auto r = reads[i].get();
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->value, "v" + std::to_string(i));
      }
    } else {
      FAIL() << "unknown op " << op;
    }
  }
};

class Conformance : public ::testing::TestWithParam<json> {};

TEST_P(Conformance, Case) {
  ASSERT_FALSE(Server().empty()) << "set RDRAM_SERVER";
  const json& c = GetParam();
  auto store = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", Server()}, {"path", std::string(c["name"]) + "/"}});
  ASSERT_TRUE(store.ok()) << store.status().message;
  Runner r{*store, {}};
  for (const auto& step : c["steps"]) {
    r.Step(step);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Conformance, ::testing::ValuesIn(LoadCases().get<std::vector<json>>()),
                         [](const ::testing::TestParamInfo<json>& info) { return info.param["name"].get<std::string>(); });

TEST(Spec, UnknownMembersAndBadValuesNameTheMember) {
  auto r = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", Server()}, {"colour", "red"}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code, StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message.find("\"colour\""), std::string::npos) << r.status().message;
  r = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", 7}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message.find("\"remote_addr\""), std::string::npos);
  r = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"memory", "lots"}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message.find("\"memory\""), std::string::npos);
  r = KvStore::Open({{"driver", "file"}, {"remote_addr", Server()}});
  EXPECT_FALSE(r.ok());
  r = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", "127.0.0.1:1"}, {"timeout_ms", 2000}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code, StatusCode::kUnavailable) << r.status().message;
}

TEST(Spec, ServerModeHostsAServerAndIsItsClient) {
  auto r = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"memory", "64MiB"}, {"workers", 1}});
  ASSERT_TRUE(r.ok()) << r.status().message;
  auto store = *r;
  ASSERT_FALSE(store->server_address().empty());
  ASSERT_TRUE(store->Write("k", std::string("in-process server")).get().ok());
  // A second, independent driver reaches the same server over UCX.
  auto other = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", store->server_address()}});
  ASSERT_TRUE(other.ok()) << other.status().message;
  auto read = (*other)->Read("k").get();
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->value, "in-process server");
}

TEST(Reads, ConcurrentReadsOfEverySizeAroundTheGuess) {
  // Reads issued together go out as one batch into 64 KiB guesses; the values on either
  // side of that size (and empty ones, and byte ranges of large ones) must all come back
  // whole, whether batched or read alone.
  auto r = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"memory", "64MiB"}, {"workers", 1}});
  ASSERT_TRUE(r.ok()) << r.status().message;
  auto store = *r;
  const std::vector<size_t> sizes = {0, 8, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, 1 << 20, 3 << 20};
  std::vector<std::string> values;
  for (size_t i = 0; i < sizes.size(); i++) {
    values.push_back(Value({{"size", sizes[i]}, {"seed", i}}));
    ASSERT_TRUE(store->Write("mix/" + std::to_string(i), values[i]).get().ok());
  }
  for (int round = 0; round < 3; round++) {
    std::vector<Future<ReadResult>> whole, tails;
    ReadOptions tail;
    tail.byte_range = ByteRange{-70000, std::nullopt};
    for (size_t i = 0; i < sizes.size(); i++) {
      whole.push_back(store->Read("mix/" + std::to_string(i)));
      if (sizes[i] >= 70000) tails.push_back(store->Read("mix/" + std::to_string(i), tail));
    }
    for (size_t i = 0, t = 0; i < sizes.size(); i++) {
      auto got = whole[i].get();
      ASSERT_TRUE(got.ok()) << got.status().message;
      EXPECT_EQ(got->value.size(), sizes[i]);
      EXPECT_TRUE(got->value == values[i]) << "value " << i << " differs";
      if (sizes[i] < 70000) continue;
      auto got_tail = tails[t++].get();
      ASSERT_TRUE(got_tail.ok()) << got_tail.status().message;
      EXPECT_TRUE(got_tail->value == values[i].substr(sizes[i] - 70000)) << "tail of " << i << " differs";
    }
  }
}

// 12.7 from C++: a client-mode driver outlives its server. The server-mode driver that
// hosts it is destroyed (reads then fail with kUnavailable) and a new one listens on the
// same address; the first driver reconnects by itself on later calls.
TEST(Recovery, ADriverReconnectsToARestartedServer) {
  json spec = {{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"memory", "64MiB"}, {"workers", 1}};
  auto host = KvStore::Open(spec);
  ASSERT_TRUE(host.ok()) << host.status().message;
  std::string addr = (*host)->server_address();
  auto client = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", addr}, {"timeout_ms", 2000}});
  ASSERT_TRUE(client.ok()) << client.status().message;
  ASSERT_TRUE((*client)->Write("k", std::string("v1")).get().ok());
  host = Result<std::shared_ptr<KvStore>>(Status{StatusCode::kUnavailable, "stopped"});  // stops the server
  auto gone = (*client)->Read("k").get();
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code, StatusCode::kUnavailable) << gone.status().message;
  spec["listen_addr"] = addr;
  auto restarted = KvStore::Open(spec);
  ASSERT_TRUE(restarted.ok()) << restarted.status().message;
  auto until_ok = [](auto call) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    auto r = call();
    while (!r.ok() && std::chrono::steady_clock::now() < deadline) r = call();
    return r;
  };
  auto wrote = until_ok([&] { return (*client)->Write("k", std::string("v2")).get(); });
  ASSERT_TRUE(wrote.ok()) << wrote.status().message;
  auto read = until_ok([&] { return (*client)->Read("k").get(); });
  ASSERT_TRUE(read.ok()) << read.status().message;
  EXPECT_EQ(read->value, "v2");
}

TEST(Spec, ServerModeOnLibfabric) {
  // The embedded server on libfabric (tcp;ofi_rxm over loopback, two rails); a second
  // driver learns the transport from the server and needs no setting of its own.
  auto r = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"memory", "64MiB"}, {"workers", 1},
                          {"transport", "fabric"}, {"provider", "tcp;ofi_rxm"}, {"domains", 2}});
  ASSERT_TRUE(r.ok()) << r.status().message;
  std::string big(3 << 20, 'f');
  ASSERT_TRUE((*r)->Write("fabric/big", big).get().ok());
  auto other = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", (*r)->server_address()}});
  ASSERT_TRUE(other.ok()) << other.status().message;
  auto read = (*other)->Read("fabric/big").get();
  ASSERT_TRUE(read.ok()) << read.status().message;
  EXPECT_TRUE(read->value == big);
  // A provider this host lacks is refused, naming what exists; so is an unknown transport.
  auto missing = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"transport", "fabric"}, {"provider", "efa"}});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code, StatusCode::kUnavailable) << missing.status().message;
  EXPECT_NE(missing.status().message.find("shm"), std::string::npos) << missing.status().message;
  auto pigeon = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"transport", "pigeon"}});
  ASSERT_FALSE(pigeon.ok());
  EXPECT_EQ(pigeon.status().code, StatusCode::kInvalidArgument) << pigeon.status().message;
  auto client_side = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", (*r)->server_address()}, {"provider", "shm"}});
  EXPECT_FALSE(client_side.ok()) << "transport settings belong to server mode";
}

// One table from statuses to codes, the gateway's too (src/error.rs, Status::grpc_code).
TEST(Errors, CodesComeFromTheLibrarysOneTable) {
  EXPECT_EQ(StatusFromC(RDRAM_AUTH_FAILED).code, StatusCode::kUnauthenticated);
  EXPECT_EQ(StatusFromC(RDRAM_WRONG_SHARD).code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(StatusFromC(RDRAM_BUFFER_TOO_SMALL).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(StatusFromC(RDRAM_NULL_ARGUMENT).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(StatusFromC(RDRAM_UNAVAILABLE).code, StatusCode::kUnavailable);
  EXPECT_EQ(StatusFromC(RDRAM_NO_SPACE).code, StatusCode::kResourceExhausted);
  EXPECT_EQ(StatusFromC(RDRAM_PANIC).code, StatusCode::kInternal);
  EXPECT_EQ(StatusFromC(RDRAM_MISSING).code, StatusCode::kOk);
  EXPECT_EQ(StatusFromC(RDRAM_CONDITION_FAILED).code, StatusCode::kOk);
  EXPECT_EQ(rdram_status_grpc_code(99), 13);  // not a status: INTERNAL
}

TEST(Errors, ResourceExhaustedWhenFull) {
  auto r = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", "127.0.0.1:0"}, {"memory", "1MiB"}, {"workers", 1}});
  ASSERT_TRUE(r.ok()) << r.status().message;
  auto w = (*r)->Write("big", std::string(2 << 20, 'x')).get();
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code, StatusCode::kInvalidArgument) << w.status().message;  // larger than the shard
  // Values that fit fill the shard until one does not. How many fit depends on the pages
  // the arena got: 1 MiB is rounded up to a 2 MiB huge page where the host has them.
  int stored = 0;
  Status full;
  for (; stored < 8; ++stored) {
    auto put = (*r)->Write("v" + std::to_string(stored), std::string(600 << 10, 'x')).get();
    if (!put.ok()) {
      full = put.status();
      break;
    }
  }
  ASSERT_GE(stored, 1) << full.message;
  ASSERT_LT(stored, 8) << "the shard never filled";
  EXPECT_EQ(full.code, StatusCode::kResourceExhausted) << full.message;
}

}  // namespace
