package coordtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/storage/mvcc"

	"github.com/go-coord/coord/internal/testenv"
)

const (
	// leaderTimeout bounds Cluster.Leader's wait for a leader.
	leaderTimeout = 30 * time.Second
	// leaderPoll is the interval at which Cluster.Leader looks again.
	leaderPoll = 5 * time.Millisecond
)

// Cluster is an embedded etcd cluster of several members for fault tests:
// each Member can be stopped, restarted and isolated from the others. Create
// it with NewCluster or NewClusterWith. The members use the tuning of a
// Server (see Config), run on loopback ports, and keep their data in
// subdirectories of t.TempDir().
//
// Raft traffic between members goes through the cluster's own peer network:
// each member advertises, as its peer URL, an HTTP proxy in front of its
// real peer listener. Member.Isolate uses it to cut a member off from its
// peers.
//
// The lifetime and failure contracts of Server apply: a t.Cleanup closes
// every client and proxy created through the cluster, then stops the
// members and the peer network, leaving no goroutine behind; methods that
// fail the test do so with the testing.TB given to NewCluster. All methods
// are safe for concurrent use.
type Cluster struct {
	t       testing.TB // the one given to NewClusterWith
	cfg     Config
	members []*Member // fixed after NewClusterWith
	net     *peerNet

	owner // what the cleanup closes before stopping the members
}

// Member is one member of a Cluster. Its name, client and peer ports and
// data directory are fixed for its whole life, across Stop and Restart.
type Member struct {
	c         *Cluster
	name      string
	peerProxy *peerProxy // the advertised peer URL
	// Set while NewClusterWith starts the cluster, fixed afterwards.
	dir            string
	clientURL      url.URL
	peerURL        url.URL // the real peer listener
	initialCluster string
	clusterToken   string

	// running is the started etcd, for lock-free inspection; nil while
	// stopped or starting.
	running atomic.Pointer[embed.Etcd]

	// lifeMu serialises starting and stopping and guards the fields below.
	lifeMu sync.Mutex
	etcd   *embed.Etcd // nil while stopped
	abort  func()      // aborts the running incarnation's RPCs, drops its connections
	done   bool        // cleanup has run; never start again
}

// NewCluster starts a Cluster of n members with the default Config and
// waits until all are ready. See NewClusterWith.
func NewCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	return NewClusterWith(t, n, Config{})
}

// NewClusterWith starts a Cluster of n members, named "m0", "m1", ...,
// tuned by cfg, and waits (up to 30 s) until every member is ready to
// serve. It fails the test with t.Fatal if the cluster cannot be started. A
// t.Cleanup closes every client and proxy created through the cluster and
// then stops it.
func NewClusterWith(t testing.TB, n int, cfg Config) *Cluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("coordtest: NewCluster with %d members", n)
	}
	base := t.TempDir() // before our Cleanup, so the dir outlives the cluster
	c := &Cluster{
		t:     t,
		cfg:   cfg.withDefaults(),
		net:   newPeerNet(),
		owner: owner{gone: "the cluster's cleanup"},
	}
	t.Cleanup(c.cleanup)

	for i := 0; i < n; i++ {
		m := &Member{c: c, name: fmt.Sprintf("m%d", i)}
		pp, err := c.net.newProxy(m)
		if err != nil {
			t.Fatalf("coordtest: starting peer proxy of member %s: %v", m.name, err)
		}
		m.peerProxy = pp
		c.members = append(c.members, m)
	}
	var err error
	for attempt := 0; attempt < portAttempts; attempt++ {
		if err = c.startAll(base, attempt); err == nil || !isAddrInUse(err) {
			break
		}
	}
	if err != nil {
		t.Fatalf("coordtest: starting etcd cluster: %v", err)
	}
	return c
}

// startAll starts every member on fresh ports and data directories and waits
// until all are ready; on error it stops those it started.
func (c *Cluster) startAll(base string, attempt int) error {
	ports, err := testenv.LoopbackPorts(2 * len(c.members))
	if err != nil {
		return err
	}
	peers := make([]string, len(c.members))
	for i, m := range c.members {
		m.clientURL = loopbackURL("http", ports[2*i])
		m.peerURL = loopbackURL("http", ports[2*i+1])
		target := m.peerURL
		m.peerProxy.target.Store(&target)
		m.dir = filepath.Join(base, fmt.Sprintf("etcd-%d-%s", attempt, m.name))
		peers[i] = m.name + "=" + m.peerProxy.url.String()
	}
	for _, m := range c.members {
		m.initialCluster = strings.Join(peers, ",")
		m.clusterToken = fmt.Sprintf("coordtest-%d", attempt)
	}

	var started []*Member
	fail := func(err error) error {
		for _, m := range started {
			m.lifeMu.Lock()
			m.stopLocked()
			m.lifeMu.Unlock()
		}
		return err
	}
	// One by one: a new member asks the others whether it has been
	// bootstrapped already, and a peer whose listener is open but not yet
	// served would keep it waiting. Starting does not wait for the others.
	for _, m := range c.members {
		c.net.setDown(m, false)
		e, abort, err := startEtcd(m.spec())
		if err != nil {
			return fail(err)
		}
		m.lifeMu.Lock()
		m.etcd, m.abort = e, abort
		m.lifeMu.Unlock()
		started = append(started, m)
	}
	// A member is ready once it has published itself through raft, which
	// needs a quorum: they become ready together.
	deadline := time.Now().Add(readyTimeout)
	for _, m := range c.members {
		if err := waitReady(m.etcd, m.Endpoint(), deadline); err != nil {
			return fail(err)
		}
	}
	for _, m := range c.members {
		c.net.setID(m, m.etcd.Server.MemberID().String())
		m.running.Store(m.etcd)
	}
	return nil
}

// Members returns the members of the cluster, in the order of their names.
func (c *Cluster) Members() []*Member {
	return slices.Clone(c.members)
}

// ClientConfig is Server.ClientConfig with the client URLs of all the
// members as endpoints.
func (c *Cluster) ClientConfig() clientv3.Config {
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = m.Endpoint()
	}
	return clientConfig(eps...)
}

// Client returns a client of all the members shared by all its callers. It
// is created on the first call and closed by the Cluster's cleanup; callers
// must not close it. It fails the test if called after that cleanup has
// started.
//
// The client spreads requests round-robin over the members it is connected
// to. Requests in progress on a member that stops fail with
// codes.Unavailable (the client retries reads, not writes). An isolated
// member stays connected and keeps getting its share of requests, which
// wait for a leader; with clientv3.WithRequireLeader they fail with
// rpctypes.ErrNoLeader instead, once the member has noticed it has none.
func (c *Cluster) Client() *clientv3.Client {
	c.t.Helper()
	return c.clientFor(c.t, c.ClientConfig(), "Cluster", "the cluster")
}

// NewClient returns a new client of all the members with its own
// connections. It is closed by a t.Cleanup, or by the Cluster's cleanup if
// that runs first; closing it earlier as well is harmless. It fails the test
// (through t) on error.
func (c *Cluster) NewClient(t testing.TB) *clientv3.Client {
	t.Helper()
	return newTestClient(t, c.ClientConfig(), c)
}

// Leader returns the current raft leader: the member that, as far as the
// running members not isolated are concerned, leads the cluster with the
// support of a majority of all the members (so an isolated member that still
// believes it leads is never returned). It waits for one until ctx ends or
// 30 s have passed, and fails the test if there is none by then.
func (c *Cluster) Leader(ctx context.Context) *Member {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(ctx, leaderTimeout)
	defer cancel()
	tick := time.NewTicker(leaderPoll)
	defer tick.Stop()
	for {
		if l := c.leader(); l != nil {
			return l
		}
		select {
		case <-ctx.Done():
			c.t.Fatalf("coordtest: no leader supported by a majority of the %d members: %v", len(c.members), ctx.Err())
			return nil
		case <-tick.C:
		}
	}
}

func (c *Cluster) leader() *Member {
	votes := make(map[uint64]int)
	byID := make(map[uint64]*Member)
	for _, m := range c.members {
		e := m.running.Load()
		if e == nil || c.net.isCut(m) {
			continue
		}
		byID[uint64(e.Server.MemberID())] = m
		if l := uint64(e.Server.Leader()); l != 0 {
			votes[l]++
		}
	}
	for id, n := range votes {
		m := byID[id]
		if m == nil || n <= len(c.members)/2 {
			continue
		}
		// The majority may lag behind a leader that has just stepped down.
		if e := m.running.Load(); e != nil && uint64(e.Server.Leader()) == id {
			return m
		}
	}
	return nil
}

// Compact compacts the store at its current revision (read linearizably from
// the leader), waits until the compaction is physically applied on the
// leader and logically applied on every other running member that is not
// isolated, and returns that revision. After it, reading or watching from an
// earlier revision through any of those members fails with ErrCompacted.
// Compacting again at an already compacted revision is not an error. It
// fails the test if there is no leader or an operation fails (e.g. ctx
// ends). A compaction that fails on the leader (it lost its place
// meanwhile, as on a starved machine) is tried again on the leader of the
// moment every 50 ms until ctx ends.
func (c *Cluster) Compact(ctx context.Context) int64 {
	c.t.Helper()
	var l *Member
	var rev int64
	for {
		var err error
		l = c.Leader(ctx)
		if rev, err = l.compact(ctx); err == nil {
			break
		}
		select {
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
			c.t.Fatalf("coordtest: %v", err)
		}
	}
	for _, m := range c.members {
		if m == l {
			continue
		}
		if err := m.syncRead(ctx); err != nil {
			c.t.Fatalf("coordtest: waiting for member %s to apply the compaction at %d: %v", m.name, rev, err)
		}
	}
	return rev
}

func (c *Cluster) cleanup() {
	proxies := c.closeClients()
	var wg sync.WaitGroup
	for _, m := range c.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.lifeMu.Lock()
			defer m.lifeMu.Unlock()
			m.done = true
			m.stopLocked()
		}()
	}
	wg.Wait()
	if err := c.net.close(); err != nil {
		c.t.Errorf("coordtest: %v", err)
	}
	for _, p := range proxies {
		p.close()
	}
}

// Name returns the member's name, "m0", "m1", ...
func (m *Member) Name() string { return m.name }

// Endpoint returns the member's client URL, "http://127.0.0.1:PORT". It does
// not change across Stop and Restart.
func (m *Member) Endpoint() string { return m.clientURL.String() }

// ClientConfig is Server.ClientConfig for this member alone.
func (m *Member) ClientConfig() clientv3.Config { return clientConfig(m.Endpoint()) }

// NewClient returns a new client whose only endpoint is this member. It is
// closed by a t.Cleanup, or by the Cluster's cleanup if that runs first;
// closing it earlier as well is harmless. It fails the test (through t) on
// error.
func (m *Member) NewClient(t testing.TB) *clientv3.Client {
	t.Helper()
	return newTestClient(t, m.ClientConfig(), m.c)
}

// NewProxy starts a Proxy in front of the member's client URL. It is closed
// by a t.Cleanup, or by the Cluster's cleanup if that runs first. It fails
// the test (through t) if the proxy cannot be started.
func (m *Member) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	return newProxy(t, m.clientURL, m.c)
}

// Stop stops the member the way a crash would: it aborts in-flight requests
// and streams with codes.Unavailable, does not hand its raft leadership
// over (if it leads, the others elect a new leader after an election
// timeout), and returns once the member is fully shut down. Stop is
// idempotent.
func (m *Member) Stop() {
	m.lifeMu.Lock()
	defer m.lifeMu.Unlock()
	m.stopLocked()
}

// Restart stops the member if it is running and starts it again on the same
// data directory and ports, so it rejoins the cluster with its state and
// existing clients reconnect by themselves. It returns once the member has
// rejoined: it has caught up with the leader and is ready to serve, which
// needs a quorum of running members. A member that is isolated cannot
// rejoin until Heal: Restart then returns once it has started. If a port is
// still in use it retries for up to 5 s. It fails the test on error,
// including when called after the Cluster's cleanup.
func (m *Member) Restart() {
	t := m.c.t
	t.Helper()
	m.lifeMu.Lock()
	defer m.lifeMu.Unlock()
	if m.done {
		t.Fatalf("coordtest: Member.Restart called after the cluster's cleanup")
	}
	m.stopLocked()
	deadline := time.Now().Add(rebindTimeout)
	var (
		e     *embed.Etcd
		abort func()
		err   error
	)
	m.c.net.setDown(m, false)
	for {
		e, abort, err = startEtcd(m.spec())
		if err == nil {
			break
		}
		if !isAddrInUse(err) || time.Now().After(deadline) {
			t.Fatalf("coordtest: restarting member %s: %v", m.name, err)
		}
		time.Sleep(rebindPoll)
	}
	if !m.c.net.isCut(m) {
		if err := waitReady(e, m.Endpoint(), time.Now().Add(readyTimeout)); err != nil {
			m.c.net.setDown(m, true)
			stopEtcd(e, abort, true)
			t.Fatalf("coordtest: restarting member %s: %v", m.name, err)
		}
	}
	m.etcd, m.abort = e, abort
	m.running.Store(e)
}

// Isolate cuts the member off from its peers, in both directions, as a
// network partition would, while clients can still reach it. Raft requests
// between it and the other members in progress are aborted and new ones are
// refused (their connection is closed), until Heal; Isolate returns once the
// aborted ones have ended, so that nothing sent before it is delivered after
// it (a read begun after Isolate cannot reach the leader). The member then finds
// itself without a leader after an election timeout (if it led, it steps
// down once it misses a quorum for that long), and the others elect a new
// leader if needed. Its linearizable reads and its writes fail with a timeout
// or rpctypes.ErrNoLeader; once it has noticed it has no leader, requests
// with clientv3.WithRequireLeader fail at once with ErrNoLeader, and after
// about three more election timeouts its watches opened with
// WithRequireLeader end with ErrNoLeader. Serializable reads still answer,
// from its possibly stale state.
//
// Isolation is enforced by the proxies of the peer network: each member's
// advertised peer URL is a proxy in front of its peer listener, so every
// request between members passes through the proxy of its target, and raft
// requests carry the member ID of their sender. Requests between members that
// do not (etcd's health probes and version checks, which carry no raft
// messages) are cut only when their target is isolated.
//
// Isolating an isolated member does nothing.
func (m *Member) Isolate() { m.c.net.cut(m) }

// Heal undoes Isolate: requests between the member and its peers go through
// again and the member rejoins the cluster within moments (its peers retry
// every 100 ms). It returns without waiting for that. Healing a member that
// is not isolated does nothing.
func (m *Member) Heal() { m.c.net.heal(m) }

func (m *Member) spec() memberSpec {
	return memberSpec{
		cfg:              m.c.cfg,
		name:             m.name,
		dir:              m.dir,
		clientURL:        m.clientURL,
		peerURL:          m.peerURL,
		advertisePeerURL: m.peerProxy.url,
		initialCluster:   m.initialCluster,
		clusterToken:     m.clusterToken,
	}
}

// stopLocked stops the running etcd, if any. lifeMu must be held.
func (m *Member) stopLocked() {
	if m.etcd == nil {
		return
	}
	m.running.Store(nil)
	m.c.net.setDown(m, true)
	stopEtcd(m.etcd, m.abort, true)
	m.etcd, m.abort = nil, nil
}

// compact compacts the member's store at its current revision and waits for
// the compaction to be physically applied; see Cluster.Compact.
func (m *Member) compact(ctx context.Context) (int64, error) {
	m.lifeMu.Lock()
	defer m.lifeMu.Unlock()
	if m.etcd == nil {
		return 0, fmt.Errorf("compacting: member %s is stopped", m.name)
	}
	resp, err := m.etcd.Server.Range(ctx, &pb.RangeRequest{Key: []byte{0}, Limit: 1})
	if err != nil {
		return 0, fmt.Errorf("reading revision from member %s: %w", m.name, err)
	}
	rev := resp.Header.Revision
	_, err = m.etcd.Server.Compact(ctx, &pb.CompactionRequest{Revision: rev, Physical: true})
	if err != nil && !errors.Is(err, mvcc.ErrCompacted) {
		return 0, fmt.Errorf("compacting at revision %d: %w", rev, err)
	}
	return rev, nil
}

// syncRead makes a linearizable read on the member, if it is running and not
// isolated, so that it has applied everything committed before the call. A
// read that fails (the leader changed meanwhile, as it does on a starved
// machine) is tried again every 50 ms until ctx ends; then the last
// failure is returned.
func (m *Member) syncRead(ctx context.Context) error {
	for {
		err := m.syncReadOnce(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
			return err
		}
	}
}

func (m *Member) syncReadOnce(ctx context.Context) error {
	m.lifeMu.Lock()
	defer m.lifeMu.Unlock()
	if m.etcd == nil || m.c.net.isCut(m) {
		return nil
	}
	_, err := m.etcd.Server.Range(ctx, &pb.RangeRequest{Key: []byte{0}, Limit: 1})
	return err
}
