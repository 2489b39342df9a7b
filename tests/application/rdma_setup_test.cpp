// The verbs control path (rdma_setup.hpp) against the stand-in libibverbs of
// tests/application/fake_ibverbs.cpp: PD / MR lifetimes and keys, QP creation parameters, the
// three modify_qp transitions with their attribute values and masks (checked against verbs.h's
// constants), IB (LID) vs RoCE (GRH) addressing, GID index choice, error messages, no leaks.
#include "mori/application/rdma/rdma_setup.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../core/scoped_env.hpp"
#include "mori/application/rdma/ibverbs_loader.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"

#if __has_include(<infiniband/verbs.h>)
#include <infiniband/verbs.h>
#endif

namespace mori::application {
namespace {

// --- GID index choice (pure) ---------------------------------------------------------------
RdmaGidInfo Gid(int index, std::vector<uint8_t> bytes, const char* type) {
  RdmaGidInfo g;
  g.index = index;
  for (size_t i = 0; i < bytes.size() && i < 16; i++) g.raw[16 - bytes.size() + i] = bytes[i];
  g.type = type;
  return g;
}

TEST(RdmaGidChoice, RequestedIndexWinsInsideTheTable) {
  RdmaPortInfo p;
  p.port = 1;
  p.linkLayer = RdmaLinkLayer::kEthernet;
  p.gidTableLen = 4;
  EXPECT_EQ(ChooseRdmaGidIndex(p, 3), 3);
  EXPECT_EQ(ChooseRdmaGidIndex(p, 0), 0);
  EXPECT_THROW(ChooseRdmaGidIndex(p, 4), core::InvalidUsageError);
  try {
    ChooseRdmaGidIndex(p, 9);
  } catch (const core::InvalidUsageError& e) {
    EXPECT_NE(e.Message().find("MORI_RDMA_GID_INDEX"), std::string::npos) << e.what();
  }
}

TEST(RdmaGidChoice, AutoPrefersRoceV2Ipv4Mapped) {
  RdmaPortInfo p;
  p.port = 1;
  p.linkLayer = RdmaLinkLayer::kEthernet;
  p.gidTableLen = 8;
  RdmaGidInfo v1 = Gid(0, {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}, "RoCE v1");
  RdmaGidInfo v2Plain = Gid(1, {0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}, "RoCE v2");
  RdmaGidInfo v1Mapped = Gid(2, {0xff, 0xff, 10, 0, 0, 2}, "RoCE v1");
  RdmaGidInfo v2Mapped = Gid(3, {0xff, 0xff, 10, 0, 0, 3}, "RoCE v2");
  RdmaGidInfo v2Mapped2 = Gid(5, {0xff, 0xff, 10, 0, 0, 5}, "RoCE v2");
  p.gids = {v1, v2Plain, v1Mapped, v2Mapped, v2Mapped2};
  EXPECT_EQ(ChooseRdmaGidIndex(p, -1), 3);
  p.gids = {v1, v2Plain, v1Mapped};
  EXPECT_EQ(ChooseRdmaGidIndex(p, -1), 0);  // no RoCE v2 IPv4-mapped GID: index 0
  p.gids = {};
  EXPECT_EQ(ChooseRdmaGidIndex(p, -1), 0);
  p.gids = {v2Mapped};
  p.linkLayer = RdmaLinkLayer::kInfiniBand;
  EXPECT_EQ(ChooseRdmaGidIndex(p, -1), 0);  // IB: not RoCE addressing
}

#ifdef MORI_FAKE_IBVERBS_PATH
// --- against the fake library --------------------------------------------------------------
// Devices (see fake_ibverbs.cpp): mlx5_0 IB, port 1 ACTIVE, LID 7, MTU 4096, GID 0 fe80::7;
// mlx5_1 Ethernet, MTU 1024, GID 0 fe80::1 RoCE v1, GID 1 ::ffff:10.0.0.1 RoCE v2;
// mlx5_3 cannot be opened (EACCES).
using FailFn = void (*)(const char*, int, int);
using ResetFn = void (*)();
using LiveFn = int (*)(const char*);
using CountFn = int (*)();
using RecordFn = int (*)(int, uint32_t*, ibv_qp_attr*, int*);
using CreateQpFn = void (*)(ibv_qp_init_attr*, int*);
using RegMrFn = void (*)(void**, size_t*, int*, int*, uint64_t*, uint64_t*);

struct ModifyRecord {
  uint32_t qpn = 0;
  ibv_qp_attr attr{};
  int mask = 0;
};

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                        IBV_ACCESS_REMOTE_ATOMIC;

class RdmaSetupFake : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    ASSERT_TRUE(LoadIbverbsApi(MORI_FAKE_IBVERBS_PATH, &api, &why)) << why;
    Sym(&fail, "fake_ibverbs_fail");
    Sym(&reset, "fake_ibverbs_reset");
    Sym(&live, "fake_ibverbs_live");
    Sym(&modifyCount, "fake_ibverbs_modify_qp_count");
    Sym(&modifyRecord, "fake_ibverbs_modify_qp_record");
    Sym(&lastCreateQp, "fake_ibverbs_last_create_qp");
    Sym(&lastRegMr, "fake_ibverbs_last_reg_mr");
    ASSERT_NE(dlsym(api.handle, "fake_ibverbs_last_modify_qp"), nullptr);
    reset();
    ExpectNoLiveObjects();
  }
  void TearDown() override {
    if (reset != nullptr) {
      reset();
      ExpectNoLiveObjects();
    }
  }
  template <typename Fn>
  void Sym(Fn* fn, const char* name) {
    *fn = reinterpret_cast<Fn>(dlsym(api.handle, name));
    ASSERT_NE(*fn, nullptr) << name;
  }
  void ExpectNoLiveObjects() {
    for (const char* kind : {"pd", "mr", "cq", "qp"}) EXPECT_EQ(live(kind), 0) << kind;
  }
  std::vector<ModifyRecord> Modifies() {
    std::vector<ModifyRecord> out(static_cast<size_t>(modifyCount()));
    for (size_t i = 0; i < out.size(); i++) {
      EXPECT_EQ(modifyRecord(static_cast<int>(i), &out[i].qpn, &out[i].attr, &out[i].mask), 0);
    }
    return out;
  }
  static std::string MessageOf(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const core::Error& e) {
      return e.Message();
    }
    return "<no exception>";
  }

  core::testing::ScopedEnv env;  // MORI_RDMA_GID_INDEX etc. unset unless a test sets them
  IbverbsApi api;
  FailFn fail = nullptr;
  ResetFn reset = nullptr;
  LiveFn live = nullptr;
  CountFn modifyCount = nullptr;
  RecordFn modifyRecord = nullptr;
  CreateQpFn lastCreateQp = nullptr;
  RegMrFn lastRegMr = nullptr;
};

TEST_F(RdmaSetupFake, LoaderResolvesTheControlPath) {
  EXPECT_NE(api.allocPd, nullptr);
  EXPECT_NE(api.deallocPd, nullptr);
  EXPECT_NE(api.regMr, nullptr);
  EXPECT_NE(api.deregMr, nullptr);
  EXPECT_NE(api.createCq, nullptr);
  EXPECT_NE(api.destroyCq, nullptr);
  EXPECT_NE(api.createQp, nullptr);
  EXPECT_NE(api.destroyQp, nullptr);
  EXPECT_NE(api.modifyQp, nullptr);
  EXPECT_NE(api.regDmabufMr, nullptr);
  EXPECT_EQ(api.regMrIova2, nullptr);  // optional; the fake does not export it
}

TEST_F(RdmaSetupFake, PdAndMrLifetimesAndKeys) {
  std::vector<uint8_t> buf(8192);
  {
    RdmaProtectionDomain pd(api, "mlx5_0");
    EXPECT_EQ(pd.DeviceName(), "mlx5_0");
    EXPECT_NE(pd.Context(), nullptr);
    EXPECT_NE(pd.Pd(), nullptr);
    EXPECT_EQ(live("pd"), 1);
    {
      RdmaMemoryRegion a(pd, buf.data(), 4096);
      RdmaMemoryRegion b(pd, buf.data() + 4096, 4096);
      EXPECT_EQ(live("mr"), 2);
      EXPECT_FALSE(a.ViaDmabuf());
      EXPECT_EQ(a.Addr(), reinterpret_cast<uintptr_t>(buf.data()));
      EXPECT_EQ(a.Length(), 4096u);
      EXPECT_EQ(a.Lkey(), a.Mr()->lkey);
      EXPECT_EQ(a.Rkey(), a.Mr()->rkey);
      EXPECT_NE(a.Lkey(), b.Lkey());
      EXPECT_NE(a.Rkey(), b.Rkey());
      EXPECT_EQ(b.Addr(), reinterpret_cast<uintptr_t>(buf.data() + 4096));

      void* addr = nullptr;
      size_t len = 0;
      int access = 0, fd = 0;
      uint64_t off = 0, iova = 0;
      lastRegMr(&addr, &len, &access, &fd, &off, &iova);
      EXPECT_EQ(addr, buf.data() + 4096);
      EXPECT_EQ(len, 4096u);
      EXPECT_EQ(fd, -1);  // plain ibv_reg_mr
      EXPECT_EQ(access, kAccess);
      EXPECT_EQ(RdmaMemoryRegionAccessFlags(), kAccess);
      EXPECT_EQ(access & IBV_ACCESS_OPTIONAL_RANGE, 0);  // the exported ibv_reg_mr suffices
    }
    EXPECT_EQ(live("mr"), 0);
  }
  EXPECT_EQ(live("pd"), 0);
  RdmaProtectionDomain pd(api, "mlx5_0");
  EXPECT_THROW(RdmaMemoryRegion(pd, nullptr, 64), core::InvalidUsageError);
  EXPECT_THROW(RdmaMemoryRegion(pd, buf.data(), 0), core::InvalidUsageError);
}

TEST_F(RdmaSetupFake, MrPrefersDmabufAndFallsBack) {
  std::vector<uint8_t> buf(4096);
  RdmaProtectionDomain pd(api, "mlx5_1");
  void* addr = nullptr;
  size_t len = 0;
  int access = 0, fd = 0;
  uint64_t off = 0, iova = 0;
  {
    RdmaMemoryRegion mr(pd, buf.data(), buf.size(), 42, 8192);
    EXPECT_TRUE(mr.ViaDmabuf());
    lastRegMr(&addr, &len, &access, &fd, &off, &iova);
    EXPECT_EQ(fd, 42);
    EXPECT_EQ(off, 8192u);
    EXPECT_EQ(iova, reinterpret_cast<uintptr_t>(buf.data()));
    EXPECT_EQ(len, buf.size());
    EXPECT_EQ(access, kAccess);
    EXPECT_EQ(mr.Addr(), reinterpret_cast<uintptr_t>(buf.data()));
  }
  {
    fail("ibv_reg_dmabuf_mr", EOPNOTSUPP, -1);
    RdmaMemoryRegion mr(pd, buf.data(), buf.size(), 42, 0);
    EXPECT_FALSE(mr.ViaDmabuf());
    lastRegMr(&addr, &len, &access, &fd, &off, &iova);
    EXPECT_EQ(fd, -1);
    EXPECT_EQ(addr, buf.data());
    reset();
  }
  {
    IbverbsApi noDmabuf = api;  // a libibverbs older than 1.12
    noDmabuf.regDmabufMr = nullptr;
    RdmaProtectionDomain pd2(noDmabuf, "mlx5_1");
    RdmaMemoryRegion mr(pd2, buf.data(), buf.size(), 42, 0);
    EXPECT_FALSE(mr.ViaDmabuf());
  }
  EXPECT_EQ(live("mr"), 0);
}

TEST_F(RdmaSetupFake, PdAndMrErrorsNameCallAndDevice) {
  EXPECT_THROW(RdmaProtectionDomain(api, "mlx5_9"), core::InvalidUsageError);
  std::string m = MessageOf([&] { RdmaProtectionDomain pd(api, "mlx5_9"); });
  EXPECT_NE(m.find("mlx5_0,mlx5_1,mlx5_2,mlx5_3"), std::string::npos) << m;

  EXPECT_THROW(RdmaProtectionDomain(api, "mlx5_3"), core::SystemError);
  m = MessageOf([&] { RdmaProtectionDomain pd(api, "mlx5_3"); });
  EXPECT_NE(m.find("ibv_open_device failed on mlx5_3"), std::string::npos) << m;
  EXPECT_NE(m.find(std::strerror(EACCES)), std::string::npos) << m;

  fail("ibv_alloc_pd", ENOMEM, -1);
  m = MessageOf([&] { RdmaProtectionDomain pd(api, "mlx5_0"); });
  EXPECT_NE(m.find("ibv_alloc_pd failed on mlx5_0"), std::string::npos) << m;
  EXPECT_NE(m.find(std::strerror(ENOMEM)), std::string::npos) << m;
  reset();

  RdmaProtectionDomain pd(api, "mlx5_0");
  std::vector<uint8_t> buf(64);
  fail("ibv_reg_mr", EFAULT, -1);
  EXPECT_THROW(RdmaMemoryRegion(pd, buf.data(), buf.size()), core::SystemError);
  m = MessageOf([&] { RdmaMemoryRegion mr(pd, buf.data(), buf.size()); });
  EXPECT_NE(m.find("ibv_reg_mr failed on mlx5_0"), std::string::npos) << m;
  EXPECT_NE(m.find(std::strerror(EFAULT)), std::string::npos) << m;
  // Both paths failing: the message keeps the dma-buf reason too.
  fail("ibv_reg_dmabuf_mr", EOPNOTSUPP, -1);
  m = MessageOf([&] { RdmaMemoryRegion mr(pd, buf.data(), buf.size(), 7, 0); });
  EXPECT_NE(m.find("ibv_reg_dmabuf_mr failed"), std::string::npos) << m;
  EXPECT_EQ(live("mr"), 0);
}

TEST_F(RdmaSetupFake, QpCreationParametersIb) {
  RdmaProtectionDomain pd(api, "mlx5_0");
  RdmaQpConfig cfg;
  cfg.cqDepth = 1000;
  cfg.maxSendWr = 512;
  cfg.maxRecvWr = 64;
  cfg.maxSendSge = 2;
  cfg.maxRecvSge = 3;
  cfg.maxInlineData = 28;
  RdmaRcQueuePair qp(pd, cfg);
  EXPECT_EQ(live("cq"), 1);
  EXPECT_EQ(live("qp"), 1);
  ibv_qp_init_attr init{};
  int cqe = 0;
  lastCreateQp(&init, &cqe);
  EXPECT_EQ(cqe, 1000);
  EXPECT_EQ(init.qp_type, IBV_QPT_RC);
  EXPECT_EQ(init.send_cq, qp.Cq());
  EXPECT_EQ(init.recv_cq, qp.Cq());
  EXPECT_EQ(init.srq, nullptr);
  EXPECT_EQ(init.sq_sig_all, 0);
  EXPECT_EQ(init.cap.max_send_wr, 512u);
  EXPECT_EQ(init.cap.max_recv_wr, 64u);
  EXPECT_EQ(init.cap.max_send_sge, 2u);
  EXPECT_EQ(init.cap.max_recv_sge, 3u);
  EXPECT_EQ(init.cap.max_inline_data, 28u);

  const RdmaConnectionInfo& info = qp.LocalInfo();
  EXPECT_FALSE(qp.IsEthernet());
  EXPECT_EQ(info.qpn, qp.Qp()->qp_num);
  EXPECT_LE(info.psn, 0xffffffu);
  EXPECT_EQ(info.lid, 7);
  EXPECT_EQ(info.mtu, IBV_MTU_4096);
  EXPECT_EQ(info.portNum, 1);
  EXPECT_EQ(info.gidIndex, 0);
  EXPECT_EQ(info.gid[0], 0xfe);
  EXPECT_EQ(info.gid[1], 0x80);
  EXPECT_EQ(info.gid[15], 0x07);
  EXPECT_FALSE(qp.Connected());
  EXPECT_EQ(modifyCount(), 0);  // created in RESET, nothing modified yet
}

TEST_F(RdmaSetupFake, ConnectIbTransitionsAttributesAndMasks) {
  RdmaProtectionDomain pd(api, "mlx5_0");
  RdmaRcQueuePair a(pd);
  RdmaRcQueuePair b(pd);
  RdmaConnectionInfo remote = b.LocalInfo();
  remote.mtu = IBV_MTU_2048;  // path MTU = min(local 4096, remote 2048)
  remote.lid = 9;
  a.Connect(remote);
  EXPECT_TRUE(a.Connected());

  std::vector<ModifyRecord> m = Modifies();
  ASSERT_EQ(m.size(), 3u);
  for (const ModifyRecord& r : m) EXPECT_EQ(r.qpn, a.LocalInfo().qpn);

  const ibv_qp_attr& init = m[0].attr;
  EXPECT_EQ(m[0].mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  EXPECT_EQ(init.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(init.pkey_index, 0);
  EXPECT_EQ(init.port_num, 1);
  EXPECT_EQ(static_cast<int>(init.qp_access_flags), kAccess);

  const ibv_qp_attr& rtr = m[1].attr;
  EXPECT_EQ(m[1].mask, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  EXPECT_EQ(rtr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(rtr.path_mtu, IBV_MTU_2048);
  EXPECT_EQ(rtr.dest_qp_num, b.LocalInfo().qpn);
  EXPECT_EQ(rtr.rq_psn, b.LocalInfo().psn);
  EXPECT_EQ(rtr.max_dest_rd_atomic, 16);
  EXPECT_EQ(rtr.min_rnr_timer, 12);
  EXPECT_EQ(rtr.ah_attr.is_global, 0);  // IB: LID routed, no GRH
  EXPECT_EQ(rtr.ah_attr.dlid, 9);
  EXPECT_EQ(rtr.ah_attr.sl, 0);
  EXPECT_EQ(rtr.ah_attr.src_path_bits, 0);
  EXPECT_EQ(rtr.ah_attr.port_num, 1);

  const ibv_qp_attr& rts = m[2].attr;
  EXPECT_EQ(m[2].mask, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  EXPECT_EQ(rts.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(rts.sq_psn, a.LocalInfo().psn);
  EXPECT_EQ(rts.timeout, 20);
  EXPECT_EQ(rts.retry_cnt, 7);
  EXPECT_EQ(rts.rnr_retry, 7);
  EXPECT_EQ(rts.max_rd_atomic, 16);
  EXPECT_EQ(a.Qp()->state, IBV_QPS_RTS);  // the fake enforces the order

  // Remote MTU above ours: ours wins.
  reset();
  remote = a.LocalInfo();
  b.Connect(remote);
  m = Modifies();
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[1].attr.path_mtu, IBV_MTU_4096);
  EXPECT_EQ(m[1].attr.ah_attr.dlid, 7);

  EXPECT_THROW(a.Connect(remote), core::InvalidUsageError);  // once per QP
}

TEST_F(RdmaSetupFake, RoceAutoGidUsesGrh) {
  RdmaProtectionDomain pd(api, "mlx5_1");
  RdmaRcQueuePair qp(pd);
  const RdmaConnectionInfo& info = qp.LocalInfo();
  EXPECT_TRUE(qp.IsEthernet());
  EXPECT_EQ(info.gidIndex, 1);  // ::ffff:10.0.0.1, RoCE v2 (GID 0 is RoCE v1)
  const uint8_t mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
  EXPECT_EQ(std::memcmp(info.gid, mapped, 16), 0);
  EXPECT_EQ(info.lid, 0);
  EXPECT_EQ(info.mtu, IBV_MTU_1024);

  RdmaConnectionInfo remote;
  remote.qpn = 0x1234;
  remote.psn = 0xabcdef;
  remote.mtu = IBV_MTU_4096;
  remote.portNum = 1;
  remote.gidIndex = 3;
  const uint8_t peer[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2};
  std::memcpy(remote.gid, peer, 16);
  qp.Connect(remote);  // lid 0 is fine on Ethernet
  std::vector<ModifyRecord> m = Modifies();
  ASSERT_EQ(m.size(), 3u);
  const ibv_qp_attr& rtr = m[1].attr;
  EXPECT_EQ(m[1].mask, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  EXPECT_EQ(rtr.path_mtu, IBV_MTU_1024);
  EXPECT_EQ(rtr.dest_qp_num, 0x1234u);
  EXPECT_EQ(rtr.rq_psn, 0xabcdefu);
  EXPECT_EQ(rtr.ah_attr.is_global, 1);
  EXPECT_EQ(rtr.ah_attr.dlid, 0);
  EXPECT_EQ(rtr.ah_attr.port_num, 1);
  EXPECT_EQ(std::memcmp(rtr.ah_attr.grh.dgid.raw, peer, 16), 0);
  EXPECT_EQ(rtr.ah_attr.grh.sgid_index, 1);  // ours, not the remote's
  EXPECT_EQ(rtr.ah_attr.grh.hop_limit, 64);
  EXPECT_EQ(rtr.ah_attr.grh.traffic_class, 0);
  EXPECT_EQ(rtr.ah_attr.grh.flow_label, 0u);
}

TEST_F(RdmaSetupFake, RoceGidIndexFromEnvAndConfig) {
  RdmaProtectionDomain pd(api, "mlx5_1");
  env.Set("MORI_RDMA_GID_INDEX", "0");
  core::ReloadEnv();
  {
    RdmaRcQueuePair qp(pd);
    EXPECT_EQ(qp.LocalInfo().gidIndex, 0);
    EXPECT_EQ(qp.LocalInfo().gid[0], 0xfe);  // fe80::1
    EXPECT_EQ(qp.LocalInfo().gid[15], 0x01);
    RdmaConnectionInfo remote = qp.LocalInfo();
    qp.Connect(remote);
    std::vector<ModifyRecord> m = Modifies();
    ASSERT_EQ(m.size(), 3u);
    EXPECT_EQ(m[1].attr.ah_attr.grh.sgid_index, 0);
    EXPECT_EQ(m[1].attr.ah_attr.is_global, 1);
  }
  {
    RdmaQpConfig cfg;
    cfg.gidIndex = 1;  // an explicit config index overrides the env
    RdmaRcQueuePair qp(pd, cfg);
    EXPECT_EQ(qp.LocalInfo().gidIndex, 1);
  }
  env.Set("MORI_RDMA_GID_INDEX", "9");  // the fake's GID table has 4 entries
  core::ReloadEnv();
  EXPECT_THROW(RdmaRcQueuePair qp(pd), core::InvalidUsageError);
  EXPECT_EQ(live("qp"), 0);
  EXPECT_EQ(live("cq"), 0);
}

TEST_F(RdmaSetupFake, QpErrorsNameCallDeviceAndPort) {
  RdmaProtectionDomain pd(api, "mlx5_0");
  fail("ibv_create_cq", ENOMEM, -1);
  std::string m = MessageOf([&] { RdmaRcQueuePair qp(pd); });
  EXPECT_NE(m.find("ibv_create_cq failed on mlx5_0 port 1"), std::string::npos) << m;
  EXPECT_NE(m.find(std::strerror(ENOMEM)), std::string::npos) << m;
  reset();

  fail("ibv_create_qp", EINVAL, -1);
  EXPECT_THROW(RdmaRcQueuePair qp(pd), core::SystemError);
  m = MessageOf([&] { RdmaRcQueuePair qp(pd); });
  EXPECT_NE(m.find("ibv_create_qp failed on mlx5_0 port 1"), std::string::npos) << m;
  EXPECT_EQ(live("cq"), 0);  // the CQ made before the failed QP is released
  reset();

  RdmaRcQueuePair a(pd);
  RdmaRcQueuePair b(pd);
  fail("ibv_modify_qp", ETIMEDOUT, IBV_QPS_RTR);
  EXPECT_THROW(a.Connect(b.LocalInfo()), core::SystemError);
  EXPECT_FALSE(a.Connected());
  std::vector<ModifyRecord> rec = Modifies();
  ASSERT_EQ(rec.size(), 2u);  // INIT succeeded, RTR failed, RTS never tried
  m = MessageOf([&] { b.Connect(a.LocalInfo()); });
  EXPECT_NE(m.find("ibv_modify_qp(RTR) failed on mlx5_0 port 1"), std::string::npos) << m;
  EXPECT_NE(m.find(std::strerror(ETIMEDOUT)), std::string::npos) << m;
  reset();

  RdmaRcQueuePair c(pd);
  fail("ibv_modify_qp", EINVAL, IBV_QPS_INIT);
  m = MessageOf([&] { c.Connect(b.LocalInfo()); });
  EXPECT_NE(m.find("ibv_modify_qp(INIT) failed on mlx5_0 port 1"), std::string::npos) << m;
  reset();
  RdmaRcQueuePair d(pd);
  fail("ibv_modify_qp", EINVAL, IBV_QPS_RTS);
  m = MessageOf([&] { d.Connect(b.LocalInfo()); });
  EXPECT_NE(m.find("ibv_modify_qp(RTS) failed on mlx5_0 port 1"), std::string::npos) << m;
}

TEST_F(RdmaSetupFake, BadRemoteDataIsARemoteError) {
  RdmaProtectionDomain pd(api, "mlx5_0");
  RdmaRcQueuePair a(pd);
  RdmaRcQueuePair b(pd);
  RdmaConnectionInfo remote = b.LocalInfo();
  remote.qpn = 0;
  EXPECT_THROW(a.Connect(remote), core::RemoteError);
  remote = b.LocalInfo();
  remote.lid = 0;  // IB needs a LID
  EXPECT_THROW(a.Connect(remote), core::RemoteError);
  remote = b.LocalInfo();
  remote.mtu = 9;
  EXPECT_THROW(a.Connect(remote), core::RemoteError);
  remote = b.LocalInfo();
  remote.psn = 0x1000000;
  EXPECT_THROW(a.Connect(remote), core::RemoteError);
  EXPECT_EQ(modifyCount(), 0);  // rejected before any transition
  a.Connect(b.LocalInfo());
  EXPECT_TRUE(a.Connected());
}
#endif  // MORI_FAKE_IBVERBS_PATH

TEST(RdmaSetup, RealLibraryResolvesTheControlPath) {
  std::string why;
  const IbverbsApi* api = Ibverbs(&why);
  if (api == nullptr) GTEST_SKIP() << why;
  EXPECT_NE(api->allocPd, nullptr);
  EXPECT_NE(api->regMr, nullptr);
  EXPECT_NE(api->createQp, nullptr);
  EXPECT_NE(api->modifyQp, nullptr);
  std::printf("ibv_reg_dmabuf_mr %s, ibv_reg_mr_iova2 %s\n",
              api->regDmabufMr != nullptr ? "present" : "absent",
              api->regMrIova2 != nullptr ? "present" : "absent");
}

TEST(RdmaSetup, MissingDeviceOnTheRealLibraryRaises) {
  std::string why;
  if (Ibverbs(&why) == nullptr) {
    EXPECT_THROW(RdmaProtectionDomain pd("mlx5_0"), core::SystemError);
    return;
  }
  // A host without devices (or without that name): not found, or no kernel support.
  EXPECT_THROW(RdmaProtectionDomain pd("mori_no_such_device"), core::Error);
}

}  // namespace
}  // namespace mori::application
