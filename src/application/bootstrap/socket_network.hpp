// The state of one SocketBootstrapNetwork and the steps its parts share. The member functions
// live with their part:
//   socket_transport.cpp    framed sends and receives on established connections; errors, and
//                           telling the peers about them
//   socket_connections.cpp  opening and identifying the connections between ranks
//   socket_rendezvous.cpp   the root's address table: ranks arrive, the root hands it out
//   socket_collectives.cpp  Allgather, AllToAll, Barrier
//   socket_bootstrap.cpp    the unique id, construction, Finalize
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "mori/application/bootstrap/socket_bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "socket_util.hpp"
#include "socket_wire.hpp"

namespace mori::application {

struct SocketBootstrapNetwork::Impl {
  // Unidentified incoming connections kept at once (the oldest is dropped beyond).
  static constexpr size_t kMaxPendingAccepts = 1024;
  // A rank waiting for the address table waits this much longer than the root's own rendezvous
  // timeout, so that it normally hears the root's verdict (which names the missing ranks).
  static constexpr int kRootVerdictGraceMs = 1000;
  // How long a failing root spends telling the ranks that arrived.
  static constexpr int kRootAbortBudgetMs = 2000;

  struct Conn {
    detail::Fd fd;
    bool atBoundary = true;  // no frame half-sent: an abort frame may be appended
  };
  struct PendingAccept {
    detail::Fd fd;
    detail::Endpoint4 from;
    detail::Hello hello{};
    size_t got = 0;
  };

  int rank = 0;
  int worldSize = 1;
  uint64_t nonce[2] = {0, 0};
  int64_t timeoutSec = 120;
  SocketAllToAllAlgorithm allToAll = SocketAllToAllAlgorithm::kAuto;
  detail::Endpoint4 rootAddr;
  detail::Fd listener;
  detail::Endpoint4 listenAddr;
  std::vector<detail::Endpoint4> addrs;
  std::vector<Conn> conns;
  std::vector<PendingAccept> pending;
  // The root's connection carrying the address table. It becomes conns[0] only when rank 0 is an
  // eager peer; otherwise rank 0 may open a separate kPeer connection later (even before the
  // table has been read here), which is why the two are told apart by the hello kind.
  detail::Fd tableConn;
  bool waitingTable = false;
  bool allPeersConnected = false;
  uint64_t seq = 0;
  bool finalized = false;
  std::string brokenReason;

  detail::Deadline NewDeadline() const { return detail::Deadline::AfterSeconds(timeoutSec); }

  // ---- socket_transport.cpp ---------------------------------------------------------------------
  void CloseAll();
  // Tell every connected peer why we fail (best effort, never blocks), then close everything.
  void Break(core::ErrorKind kind, const std::string& reason);

  // Runs `body`; an exception breaks the network (peers are told) and is rethrown.
  template <typename F>
  void Guarded(F&& body) {
    try {
      body();
    } catch (const core::Error& e) {
      Break(e.Kind(), e.Message());
      throw;
    } catch (const std::exception& e) {
      Break(core::ErrorKind::kInternal, e.what());
      throw;
    }
  }

  void CheckUsable(const char* what) const;

  // Raises the error an abort or reject frame carries. `text` is the sender's reason.
  [[noreturn]] void RaiseFromErrorFrame(const detail::FrameHeader& h, int peer,
                                        const std::string& text, const char* what) const;

  // One send and/or one receive of a frame, progressed together. Waiting without progress for
  // timeoutSec raises TimeoutError naming the peer(s).
  struct SendSpec {
    int fd = -1;
    int peer = -1;
    bool* atBoundary = nullptr;
    detail::FrameHeader header{};
    const void* data = nullptr;
  };
  struct RecvSpec {
    int fd = -1;
    int peer = -1;
    detail::FrameType type = detail::FrameType::kAck;
    uint32_t step = 0;
    uint64_t seq = 0;
    void* data = nullptr;
    uint64_t length = 0;
  };
  // Reads the reason text following an abort/reject header and raises it.
  [[noreturn]] void ReadErrorText(int fd, int peer, const detail::FrameHeader& h,
                                  const char* what) const;
  void CheckHeader(const detail::FrameHeader& h, const RecvSpec& r, const std::string& what) const;
  void Exchange(SendSpec* s, RecvSpec* r, const std::string& what);

  Conn& ConnTo(int peer);
  // Sends `sendLen` bytes to `to` and receives `recvLen` bytes from `from` as one step of a
  // collective (either side may be skipped with -1).
  void Step(detail::FrameType type, uint32_t step, int to, const void* sendData, size_t sendLen,
            int from, void* recvData, size_t recvLen, const char* what);

  // ---- socket_connections.cpp -------------------------------------------------------------------
  // rank r's peers at distance ±2^k: the ring (k = 0) and the dissemination barrier / Bruck set.
  std::vector<int> EagerPeers() const;
  bool IsEagerPeer(int p) const;

  void AcceptPending();
  // Reads hello bytes of pending[i]. Returns true when complete; drops the entry (and returns
  // false) when the peer closed first.
  bool ReadHello(size_t i);
  // Empty when the hello is acceptable, else the reason.
  std::string CheckHelloCommon(const detail::Hello& h, detail::HelloKind kind) const;
  // Identifies pending peer connections (hello kind kPeer from a lower rank); pending[k] is polled
  // in fds[firstPending + k]. Appends the ranks identified to *identified.
  void ServicePeerAccepts(const std::vector<pollfd>& fds, size_t firstPending, size_t count,
                          std::vector<int>* identified);
  // Makes sure a connection to every rank in `peers` exists: opens the ones to higher ranks,
  // accepts the ones from lower ranks (connections from other lower ranks are kept as well).
  // With waitTable (rendezvous of a non-root rank) it also waits for the root's connection and
  // reads the address table from it.
  void EnsureConnections(const std::vector<int>& peers, const char* what, bool waitTable = false);

  // ---- socket_rendezvous.cpp --------------------------------------------------------------------
  void ReceiveTable();
  detail::Fd ConnectToRoot(const detail::Deadline& dl);
  void ClientRendezvous();
  // Root: connects to an arrived rank and sends hello + the given frame; returns the connection.
  detail::Fd RootSendTo(int r, detail::FrameType type, uint32_t step, const void* payload,
                        size_t len, const detail::Deadline& dl);
  // Root failed during rendezvous: tell the ranks that arrived (best effort, bounded).
  void RootAbortArrived(const std::vector<char>& arrived, int firstRank, core::ErrorKind kind,
                        const std::string& reason);
  std::string CheckRendezvousHello(const detail::Hello& h, const std::vector<char>& arrived) const;
  void RootRendezvous();
};

}  // namespace mori::application
