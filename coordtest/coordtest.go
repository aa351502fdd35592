// Package coordtest runs etcd inside Go tests. It is meant to be imported by
// anyone who tests Go code against etcd, as net/http/httptest is for HTTP
// code and miniredis for Redis clients: no etcd binary, container or network
// is needed, only the test process and loopback ports. Package coord uses it
// for its own tests, but nothing in it is specific to coord.
//
// It offers:
//
//   - Server: a single-member etcd embedded in the test process
//     (go.etcd.io/etcd/server/v3/embed), on free loopback ports, with its
//     data in t.TempDir(). It hands out clients, and can be stopped,
//     restarted and compacted.
//   - Cluster: an embedded etcd of several members, each of which can be
//     stopped, restarted and isolated from the others, for tests of leader
//     loss and network partitions.
//   - Proxy: a TCP proxy in front of a Server or a Cluster Member that
//     blackholes, pauses or delays the connections through it, as a network
//     fault would, while the server keeps running.
//   - Standalone: a Server outside a test (runnable examples, demos,
//     tools), started by Start with its data in a given directory (StartAt:
//     at a given address, its data kept there). Its methods return errors
//     where a Server's fail the test; Close stops it.
//   - Process and ProcessCluster: an etcd binary of any version run as a
//     child process, alone or as a cluster, with the surface of a Server,
//     for compatibility tests. NewEtcd returns a Process of the binary that
//     the environment variable COORD_TEST_ETCD names, else a Server: the
//     Etcd interface they share lets one test run on both.
//   - GRPCProxy: etcd's gRPC proxy (`etcd grpc-proxy start`) in front of
//     an Etcd, which coalesces its clients' watches: the binary's own in
//     front of a Process, else run in the test process. It can be stopped
//     and restarted on its address.
//
// Servers and members are tuned for tests (see Config): a 10 ms heartbeat
// (TickMs) and a 100 ms election timeout (ElectionMs), so that etcd grants a
// lease TTL of 1 s (its smallest TTL is 1.5 election timeouts, rounded up to
// a second: 2 s with etcd's defaults) and elects a leader within moments;
// no fsync, no auto-compaction, no metrics listener, no gRPC gateway and no
// logging.
//
// Lifetime contract: everything a Server, Standalone, Cluster, Proxy or
// GRPCProxy creates (the etcd servers, the clients handed out, the proxies and their
// connections) is released by t.Cleanup functions, or by Server.Close or
// Standalone.Close, and once those have run no goroutine started by them
// remains, so the package can be used together with goleak.VerifyTestMain.
// (A deferred goleak.VerifyNone(t) runs before t.Cleanup, so it would see
// the server still running; register it with t.Cleanup before calling
// NewServer instead, or use VerifyTestMain.)
//
// Failure contract: the package reports failures to the testing.TB given to
// NewServer, NewCluster, NewProxy, NewGRPCProxy or NewClient. Methods
// documented to fail the test call its Fatal method; like
// testing.T.FailNow, they must then be called from the goroutine running
// that test. Outside a test, Start and the methods of a Standalone return
// those failures as errors instead. All methods are safe for concurrent
// use.
package coordtest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/snapshot"
	etcdutl "go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.etcd.io/etcd/pkg/v3/featuregate"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/storage/mvcc"
	"go.uber.org/zap"
	"golang.org/x/crypto/bcrypt"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/go-coord/coord/internal/testenv"
)

// Default timing of a Server, used for the zero fields of Config.
const (
	// DefaultTickMs is the raft heartbeat interval in milliseconds.
	DefaultTickMs = 10
	// DefaultElectionMs is the raft election timeout in milliseconds. With
	// DefaultTickMs it makes etcd's minimum lease TTL 1 s.
	DefaultElectionMs = 100
	// ClientDialTimeout is the DialTimeout of the client configurations
	// returned by the ClientConfig methods (of Server, Standalone, Member
	// and Proxy).
	ClientDialTimeout = 5 * time.Second
	// ClientConnectTimeout is the gRPC MinConnectTimeout of the client
	// configurations returned by the ClientConfig methods: a connection
	// attempt whose server preface has not arrived by then is given up,
	// and tried again after a backoff of at most 500 ms, so that a client
	// reconnects soon after a fault heals. A link delayed (Proxy.Delay) by
	// about this much each way can therefore make no new connection: the
	// preface arrives one delay late, plus the handshake's own time.
	ClientConnectTimeout = time.Second
)

const (
	// readyTimeout bounds the wait for a started server to become ready.
	// Generous because tests also run under slow emulation.
	readyTimeout = 30 * time.Second
	// rebindTimeout bounds how long Restart keeps retrying while the old
	// ports are still in use.
	rebindTimeout = 5 * time.Second
	// rebindPoll is the interval between those retries.
	rebindPoll = 20 * time.Millisecond
	// portAttempts is how many sets of fresh ports NewServer and NewProxy
	// try before giving up.
	portAttempts = 5
)

// Config tunes a Server, or the members of a Cluster. The zero value gives
// the defaults.
type Config struct {
	// TickMs is the raft heartbeat interval in milliseconds.
	// Zero means DefaultTickMs.
	TickMs uint
	// ElectionMs is the raft election timeout in milliseconds; it must be at
	// least 5*TickMs. Zero means 10*TickMs (DefaultElectionMs with the
	// default TickMs). etcd's minimum lease TTL is
	// ceil(1.5*ElectionMs / 1000) seconds.
	ElectionMs uint
	// LeaseCheckpoint turns on etcd's lease checkpointing: the leader
	// records the remaining TTL of long leases in raft, so that a new
	// leader resumes their countdown instead of granting them their full
	// TTL again. etcd checkpoints only the leases whose remaining TTL
	// exceeds its checkpoint interval, 5 minutes, which its command line
	// cannot change.
	LeaseCheckpoint bool
	// Logger receives the embedded server's logs. Nil means zap.NewNop().
	// A zaptest logger is fine: the server logs nothing after its cleanup.
	Logger *zap.Logger
}

func (c Config) withDefaults() Config {
	if c.TickMs == 0 {
		c.TickMs = DefaultTickMs
	}
	if c.ElectionMs == 0 {
		c.ElectionMs = 10 * c.TickMs
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Server is an embedded single-member etcd listening on loopback ports, with
// its data in a subdirectory of t.TempDir(). Create it with NewServer or
// NewServerWith; outside a test, use Start and a Standalone. Its client and
// peer ports and its data directory are fixed for its whole life, across
// Stop and Restart.
type Server struct {
	// t is the test's testing.TB, which the exported methods fail; nil in
	// the Server of a Standalone, which uses only the unexported ones.
	t         testing.TB
	cfg       Config
	dir       string
	clientURL url.URL
	peerURL   url.URL
	// token is the cluster token of the etcd started next ("": etcd's
	// default); each Replace takes a new one.
	token                         string
	replaced, restored, snapshots int

	// lifeMu serialises starting and stopping and guards the fields below.
	lifeMu sync.Mutex
	etcd   *embed.Etcd // nil while stopped
	abort  func()      // aborts the running incarnation's RPCs, drops its connections
	done   bool        // Close has run; never start again

	closeOnce sync.Once

	owner // what Close closes before stopping the server
}

// NewServer starts a Server with the default Config and waits until it is
// ready to serve. See NewServerWith.
func NewServer(t testing.TB) *Server {
	t.Helper()
	return NewServerWith(t, Config{})
}

// NewServerWith starts a Server tuned by cfg and waits (up to 30 s) until it
// is ready to serve. It fails the test with t.Fatal if the server cannot be
// started. A t.Cleanup calls Close: it closes every client and proxy created
// through the Server and then stops the server.
func NewServerWith(t testing.TB, cfg Config) *Server {
	t.Helper()
	base := t.TempDir() // before our Cleanup, so the dir outlives the server
	s := newServer(t, cfg)
	t.Cleanup(s.Close)
	if err := s.start(base); err != nil {
		t.Fatalf("coordtest: %v", err)
	}
	return s
}

// newServer returns a stopped Server failing t (nil for a Standalone).
func newServer(t testing.TB, cfg Config) *Server {
	return &Server{t: t, cfg: cfg.withDefaults(), owner: owner{gone: "the server was closed"}}
}

// start picks free loopback ports and a fresh data directory in base and
// starts the server there, trying again on other ports if one was taken
// meanwhile.
func (s *Server) start(base string) error {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	var err error
	for attempt := 0; attempt < portAttempts; attempt++ {
		var ports []int
		if ports, err = testenv.LoopbackPorts(2); err != nil {
			break
		}
		s.clientURL = loopbackURL("http", ports[0])
		s.peerURL = loopbackURL("http", ports[1])
		// A fresh directory per attempt: a failed attempt may leave files,
		// and base may hold an earlier server's data.
		if s.dir, err = os.MkdirTemp(base, "etcd-"); err != nil {
			break
		}
		if err = s.startLocked(); err == nil {
			return nil
		}
		_ = os.RemoveAll(s.dir)
		if !isAddrInUse(err) {
			break
		}
	}
	return fmt.Errorf("starting etcd: %w", err)
}

// Endpoint returns the client URL of the server, "http://127.0.0.1:PORT". It
// does not change across Stop and Restart.
func (s *Server) Endpoint() string {
	return s.clientURL.String()
}

// ClientConfig returns a configuration for a client of this server: its
// Endpoint, a DialTimeout of ClientDialTimeout, a no-op Logger, default
// keepalive settings, and gRPC dial options for prompt reconnection: a
// reconnect backoff capped at 500 ms (gRPC's default cap is 120 s) and a
// 1 s connection-attempt timeout (default 20 s; a Proxy in front of a
// stopped server accepts connections and leaves them hanging). Callers may
// adjust it and pass it to clientv3.New themselves; they then own the client
// and must close it.
func (s *Server) ClientConfig() clientv3.Config {
	return clientConfig(s.Endpoint())
}

// Client returns a client of this server shared by all its callers. It is
// created on the first call and closed by the Server's Close (its cleanup);
// callers must not close it. It fails the test if called after Close has
// started.
func (s *Server) Client() *clientv3.Client {
	s.t.Helper()
	return s.clientFor(s.t, s.ClientConfig(), "Server", s.Endpoint())
}

// NewClient returns a new client of this server with its own connection. It
// is closed by a t.Cleanup, or by the Server's Close if that runs first;
// closing it earlier as well is harmless. It fails the test (through t) on
// error.
func (s *Server) NewClient(t testing.TB) *clientv3.Client {
	t.Helper()
	return newTestClient(t, s.ClientConfig(), s)
}

// Stop stops the server: it aborts in-flight requests and streams with
// codes.Unavailable (as a crashed server would, so clients retry rather than
// give up), closes its connections and listeners without waiting for any
// client (not even one cut off behind a Proxy, which etcd's graceful stop
// would wait 5 s for), and returns when the server is fully shut down.
// Clients stay open and reconnect after Restart. Stop is idempotent.
//
// Leases do not expire while the server is stopped: on restart etcd renews
// every lease for its full TTL. To make a client's lease expire, cut the
// client off with a Proxy instead.
func (s *Server) Stop() {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	s.stopLocked()
}

// Restart stops the server if it is running and starts it again on the same
// data directory and ports, so existing clients reconnect by themselves. It
// returns once the server is ready to serve. If a port is still in use it
// retries for up to 5 s. It fails the test on error, including when called
// after Close.
func (s *Server) Restart() {
	s.t.Helper()
	s.fatalIf(s.restart())
}

// Revision returns the current revision of the store, read linearizably. It
// fails the test if the server is stopped or closed, or the read fails (e.g.
// ctx ends).
func (s *Server) Revision(ctx context.Context) int64 {
	s.t.Helper()
	return s.mustRev(s.revision(ctx))
}

// Compact compacts the store at its current revision and waits until the
// compaction is physically applied; it returns that revision. After it,
// reading or watching from an earlier revision fails with ErrCompacted.
// Compacting again at an already compacted revision is not an error. It
// fails the test if the server is stopped or closed, or the compaction
// fails.
func (s *Server) Compact(ctx context.Context) int64 {
	s.t.Helper()
	return s.mustRev(s.compact(ctx))
}

// mustRev returns rev, failing the test with err if set.
func (s *Server) mustRev(rev int64, err error) int64 {
	s.t.Helper()
	s.fatalIf(err)
	return rev
}

// fatalIf fails the test with err if set.
func (s *Server) fatalIf(err error) {
	s.t.Helper()
	if err != nil {
		s.t.Fatalf("coordtest: %v", err)
	}
}

// Replace stops the server and starts an empty etcd in its place, on the
// same ports: a cluster rebuilt, whose revisions start over. It is a new
// cluster, with a cluster token and so a cluster ID of its own, as etcd
// asks of a cluster rebuilt. Clients stay open and reconnect to it by
// themselves; their leases are gone. It fails the test as Restart does.
func (s *Server) Replace() {
	s.t.Helper()
	s.fatalIf(s.restartWith(func() error {
		s.replaced++
		s.token = fmt.Sprintf("coordtest-replaced-%d", s.replaced)
		return s.empty()
	}))
}

// Reset is Replace on the same cluster token: the same cluster ID (etcd
// derives it from the members' URLs and the token), its data gone and its
// revisions started over, as a development etcd run again without its
// data.
func (s *Server) Reset() {
	s.t.Helper()
	s.fatalIf(s.restartWith(s.empty))
}

// Snapshot saves the server's keyspace to a new file next to its data
// directory, as `etcdctl snapshot save` does, and returns its path. It
// fails the test if the server does not answer within ctx.
func (s *Server) Snapshot(ctx context.Context) string {
	s.t.Helper()
	path, err := s.snapshot(ctx)
	s.fatalIf(err)
	return path
}

// snapshot is Snapshot, returning its failure.
func (s *Server) snapshot(ctx context.Context) (string, error) {
	s.lifeMu.Lock()
	s.snapshots++
	path := filepath.Join(filepath.Dir(s.dir), fmt.Sprintf("snapshot-%d.db", s.snapshots))
	s.lifeMu.Unlock()
	if _, err := snapshot.SaveWithVersion(ctx, zap.NewNop(), s.ClientConfig(), path); err != nil {
		return "", fmt.Errorf("saving a snapshot: %w", err)
	}
	return path, nil
}

// Restore stops the server and starts it again on the keyspace of the
// snapshot at path (see Snapshot), in a new data directory, as `etcdutl
// snapshot restore` does: the same cluster, its revision back to the
// snapshot's, the leases of the snapshot kept. With bump > 0 the revision
// is raised by bump and marked compacted (`--bump-revision bump
// --mark-compacted`): revisions never go back, and a watch from before is
// told that its revision was compacted. It fails the test as Restart does.
func (s *Server) Restore(path string, bump uint64) {
	s.t.Helper()
	s.fatalIf(s.restartWith(func() error {
		s.restored++
		dir := filepath.Join(filepath.Dir(s.dir), fmt.Sprintf("restored-%d", s.restored))
		defaults := embed.NewConfig()
		err := etcdutl.NewV3(zap.NewNop()).Restore(etcdutl.RestoreConfig{
			SnapshotPath: path, Name: defaults.Name, OutputDataDir: dir,
			PeerURLs:            []string{s.peerURL.String()},
			InitialCluster:      defaults.Name + "=" + s.peerURL.String(),
			InitialClusterToken: cmp.Or(s.token, defaults.InitialClusterToken),
			RevisionBump:        bump, MarkCompacted: bump > 0,
		})
		if err != nil {
			return fmt.Errorf("restoring a snapshot: %w", err)
		}
		s.dir = dir
		return nil
	}))
}

// restart is Restart, returning its failure.
func (s *Server) restart() error { return s.restartWith(nil) }

// empty removes the server's data.
func (s *Server) empty() error {
	if err := os.RemoveAll(s.dir); err != nil {
		return fmt.Errorf("emptying etcd's data directory: %w", err)
	}
	return nil
}

// restartWith restarts the server, with prepare, if set, run while it is
// stopped.
func (s *Server) restartWith(prepare func() error) error {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	if s.done {
		return errors.New("Restart called after the server was closed")
	}
	s.stopLocked()
	if prepare != nil {
		if err := prepare(); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(rebindTimeout)
	for {
		err := s.startLocked()
		if err == nil {
			return nil
		}
		if !isAddrInUse(err) || time.Now().After(deadline) {
			return fmt.Errorf("restarting etcd: %w", err)
		}
		time.Sleep(rebindPoll)
	}
}

// revision is Revision, returning its failure.
func (s *Server) revision(ctx context.Context) (int64, error) {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	return s.revisionLocked(ctx)
}

// compact is Compact, returning its failure.
func (s *Server) compact(ctx context.Context) (int64, error) {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	rev, err := s.revisionLocked(ctx)
	if err != nil {
		return 0, err
	}
	_, err = s.etcd.Server.Compact(ctx, &pb.CompactionRequest{Revision: rev, Physical: true})
	if err != nil && !errors.Is(err, mvcc.ErrCompacted) {
		return 0, fmt.Errorf("compacting at revision %d: %w", rev, err)
	}
	return rev, nil
}

// revisionLocked reads the current revision. lifeMu must be held.
func (s *Server) revisionLocked(ctx context.Context) (int64, error) {
	if s.done {
		return 0, errors.New("reading revision: the server was closed")
	}
	if s.etcd == nil {
		return 0, errors.New("reading revision: server is stopped")
	}
	resp, err := s.etcd.Server.Range(ctx, &pb.RangeRequest{Key: []byte{0}, Limit: 1})
	if err != nil {
		return 0, fmt.Errorf("reading revision: %w", err)
	}
	return resp.Header.Revision, nil
}

// startLocked starts an etcd on s.dir, s.clientURL and s.peerURL and waits
// until it is ready. lifeMu must be held and the server stopped.
func (s *Server) startLocked() error {
	e, abort, err := startEtcd(s.spec())
	if err != nil {
		return err
	}
	if err := waitReady(e, s.Endpoint(), time.Now().Add(readyTimeout)); err != nil {
		stopEtcd(e, abort, false)
		return err
	}
	s.etcd, s.abort = e, abort
	return nil
}

// stopLocked stops the running etcd, if any. lifeMu must be held.
func (s *Server) stopLocked() {
	if s.etcd == nil {
		return
	}
	stopEtcd(s.etcd, s.abort, false)
	s.etcd, s.abort = nil, nil
}

func (s *Server) spec() memberSpec {
	return memberSpec{cfg: s.cfg, dir: s.dir, clientURL: s.clientURL, peerURL: s.peerURL, clusterToken: s.token}
}

// memberSpec describes an embedded etcd member: a Server, or a member of a
// Cluster.
type memberSpec struct {
	cfg       Config
	name      string // "" means embed's default name
	dir       string
	clientURL url.URL
	peerURL   url.URL // the peer listener
	// advertisePeerURL is the peer URL announced to the cluster; the zero
	// value means peerURL.
	advertisePeerURL url.URL
	// initialCluster and clusterToken bootstrap a multi-member cluster (a
	// clusterToken alone: a Server replaced); an
	// empty initialCluster means a single-member cluster of this member.
	initialCluster string
	clusterToken   string
}

func (sp memberSpec) endpoint() string { return sp.clientURL.String() }

func (sp memberSpec) embedConfig(rpcCtx context.Context) *embed.Config {
	cfg := embed.NewConfig()
	if sp.name != "" {
		cfg.Name = sp.name
	}
	cfg.Dir = sp.dir
	cfg.TickMs = sp.cfg.TickMs
	cfg.ElectionMs = sp.cfg.ElectionMs
	cfg.ListenClientUrls = []url.URL{sp.clientURL}
	cfg.AdvertiseClientUrls = []url.URL{sp.clientURL}
	cfg.ListenPeerUrls = []url.URL{sp.peerURL}
	cfg.AdvertisePeerUrls = []url.URL{sp.peerURL}
	if sp.advertisePeerURL.Host != "" {
		cfg.AdvertisePeerUrls = []url.URL{sp.advertisePeerURL}
	}
	if sp.initialCluster != "" {
		cfg.InitialCluster = sp.initialCluster
	} else {
		cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	}
	if sp.clusterToken != "" {
		cfg.InitialClusterToken = sp.clusterToken
	}
	cfg.ListenMetricsUrls = nil
	if sp.cfg.LeaseCheckpoint {
		// The gate is valid: Set fails only on an unknown feature.
		_ = cfg.ServerFeatureGate.(featuregate.MutableFeatureGate).Set("LeaseCheckpoint=true")
	}
	cfg.UnsafeNoFsync = true
	// Password hashing at its cheapest: tests with auth log users in often.
	cfg.BcryptCost = uint(bcrypt.MinCost)
	cfg.AutoCompactionRetention = "0"
	cfg.EnableGRPCGateway = false
	cfg.Logger = "zap"
	cfg.LogLevel = "error"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(sp.cfg.Logger)
	cfg.GRPCAdditionalServerOptions = []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(abortUnary(rpcCtx)),
		grpc.ChainStreamInterceptor(abortStream(rpcCtx)),
		// Make gRPC's Stop wait for method handlers, so no handler
		// goroutine outlives Etcd.Close.
		grpc.WaitForHandlers(true),
	}
	return cfg
}

// startEtcd starts an embedded etcd as described by sp, without waiting for
// it to become ready. The returned function aborts its in-flight RPCs and
// drops its client connections; pass both to stopEtcd.
func startEtcd(sp memberSpec) (*embed.Etcd, func(), error) {
	rpcCtx, stopRPCs := context.WithCancel(context.Background())
	var (
		mu      sync.Mutex
		servers []*grpc.Server // etcd's gRPC servers, once it serves
	)
	cfg := sp.embedConfig(rpcCtx)
	cfg.ServiceRegister = func(gs *grpc.Server) {
		mu.Lock()
		defer mu.Unlock()
		servers = append(servers, gs)
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		stopRPCs()
		return nil, nil, fmt.Errorf("starting embedded etcd on %s: %w", sp.endpoint(), err)
	}
	abort := func() {
		stopRPCs()
		mu.Lock()
		defer mu.Unlock()
		for _, gs := range servers {
			gs.Stop() // closes every connection, then waits for the handlers
		}
	}
	return e, abort, nil
}

// waitReady waits until e is ready to serve, it fails, or the deadline
// passes. On error the caller must still stop e.
func waitReady(e *embed.Etcd, endpoint string, deadline time.Time) error {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case <-e.Server.ReadyNotify():
		return nil
	case err := <-e.Err():
		return fmt.Errorf("embedded etcd on %s failed before becoming ready: %v", endpoint, err)
	case <-e.Server.StopNotify():
		return fmt.Errorf("embedded etcd on %s stopped before becoming ready", endpoint)
	case <-timer.C:
		return fmt.Errorf("embedded etcd on %s not ready after %v", endpoint, readyTimeout)
	}
}

// stopEtcd stops an etcd started by startEtcd and returns once it is fully
// shut down. With hard set it stops the way a crash would, without first
// handing its raft leadership over (etcd's graceful stop does that, and it
// may wait its request timeout, over 5 s, when no peer takes over).
func stopEtcd(e *embed.Etcd, abort func(), hard bool) {
	// Abort in-flight RPCs and drop the client connections first, as a
	// crash does: Etcd.Close stops gRPC gracefully, which waits its request
	// timeout (over 5 s) for open watch and lease keepalive streams, and up
	// to 5 s for each client to answer its goodbye, which a client behind a
	// partition (a blackholed or paused Proxy) never does.
	abort()
	if hard {
		// Etcd.Close still attempts the leadership transfer, but on a
		// stopped server that gives up at once.
		e.Server.HardStop()
	}
	e.Close() // returns once the server and all its handlers are done
}

// Close closes every client and proxy handed out by the server, then stops
// it, and returns once none of their goroutines remains. The server cannot
// be restarted afterwards, and its data stays in its directory. Close is
// idempotent and safe to call concurrently: every call returns once the
// first is done. A Server from NewServer need not be closed: a t.Cleanup
// does it, and closing it earlier as well is harmless.
func (s *Server) Close() {
	s.closeOnce.Do(s.close)
}

func (s *Server) close() {
	proxies := s.closeClients()
	s.lifeMu.Lock()
	s.done = true
	s.stopLocked()
	s.lifeMu.Unlock()
	// Proxies last: with the server gone, no connection through a proxy can
	// keep its Close waiting.
	for _, p := range proxies {
		p.close()
	}
}

func clientConfig(endpoints ...string) clientv3.Config {
	return clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: ClientDialTimeout,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff: backoff.Config{
					BaseDelay:  50 * time.Millisecond,
					Multiplier: 1.6,
					Jitter:     0.2,
					MaxDelay:   500 * time.Millisecond,
				},
				MinConnectTimeout: ClientConnectTimeout,
			}),
		},
	}
}

// abortUnary returns an interceptor that cancels unary calls when ctx ends
// and then reports them (and any later call) as codes.Unavailable.
func abortUnary(ctx context.Context) grpc.UnaryServerInterceptor {
	return func(rctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if ctx.Err() != nil {
			return nil, errStopping()
		}
		rctx, cancel := context.WithCancel(rctx)
		stop := context.AfterFunc(ctx, cancel)
		defer func() {
			stop()
			cancel()
		}()
		resp, err := handler(rctx, req)
		if err != nil && ctx.Err() != nil {
			return nil, errStopping()
		}
		return resp, err
	}
}

// abortStream is abortUnary for streams.
func abortStream(ctx context.Context) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if ctx.Err() != nil {
			return errStopping()
		}
		sctx, cancel := context.WithCancel(ss.Context())
		stop := context.AfterFunc(ctx, cancel)
		defer func() {
			stop()
			cancel()
		}()
		err := handler(srv, ctxServerStream{ServerStream: ss, ctx: reasonCtx{Context: sctx, parent: ss.Context()}})
		if ctx.Err() != nil {
			return errStopping()
		}
		return err
	}
}

func errStopping() error {
	return status.Error(codes.Unavailable, "coordtest: etcd server is stopping")
}

type ctxServerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s ctxServerStream) Context() context.Context { return s.ctx }

// reasonCtx is a context derived from parent whose Err reports parent's
// error once parent is done. etcd cancels the streams of a member that lost
// its leader through a context whose Err is rpctypes.ErrGRPCNoLeader, and
// its handlers pass that error on to the client; a plain derived context
// would report context.Canceled instead.
type reasonCtx struct {
	context.Context
	parent context.Context
}

func (c reasonCtx) Err() error {
	if err := c.parent.Err(); err != nil {
		return err
	}
	return c.Context.Err()
}

func loopbackURL(scheme string, port int) url.URL {
	return url.URL{Scheme: scheme, Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
}

func isAddrInUse(err error) bool {
	return errors.Is(err, syscall.EADDRINUSE)
}
