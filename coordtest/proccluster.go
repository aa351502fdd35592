package coordtest

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/internal/testenv"
)

// ProcessCluster is a cluster of etcd processes of one binary, each member
// a Process, for the tests of leader changes on a real etcd: a member can be
// killed and restarted, and the leadership moved. Create it with
// NewProcessCluster. Members talk to each other directly (there is no peer
// network to isolate them: use a Cluster for partitions).
//
// A t.Cleanup closes every client and proxy created through the cluster or
// its members, then kills the members. Methods that fail the test do so
// with the testing.TB given to NewProcessCluster. All methods are safe for
// concurrent use.
type ProcessCluster struct {
	t       testing.TB
	members []*Process // fixed after NewProcessCluster

	owner // the cluster-wide clients
}

// NewProcessCluster runs n members of the etcd binary bin, named "m0",
// "m1", ..., tuned by cfg, and waits (up to 30 s) until every member is
// ready to serve. It fails the test if the cluster cannot be started,
// quoting the end of a failing member's log.
func NewProcessCluster(t testing.TB, bin string, n int, cfg Config) *ProcessCluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("coordtest: NewProcessCluster with %d members", n)
	}
	ver, err := BinaryVersion(bin)
	if err != nil {
		t.Fatalf("coordtest: %v", err)
	}
	base := t.TempDir()
	c := &ProcessCluster{t: t, owner: owner{gone: "the cluster's cleanup"}}
	t.Cleanup(c.cleanup)
	for attempt := 0; attempt < portAttempts; attempt++ {
		if err = c.startAll(bin, ver, cfg, filepath.Join(base, fmt.Sprint(attempt)), n, attempt); err == nil || !errors.Is(err, errPortTaken) {
			break
		}
	}
	if err != nil {
		t.Fatalf("coordtest: starting etcd cluster: %v", err)
	}
	return c
}

// startAll runs n members on fresh ports and waits until all are ready;
// on error it kills them.
func (c *ProcessCluster) startAll(bin string, ver Version, cfg Config, base string, n, attempt int) error {
	ports, err := testenv.LoopbackPorts(2 * n)
	if err != nil {
		return err
	}
	members := make([]*Process, n)
	peers := make([]string, n)
	for i := range members {
		name := fmt.Sprintf("m%d", i)
		m := newProcess(c.t, bin, ver, cfg, filepath.Join(base, name), name)
		m.clientURL = loopbackURL("http", ports[2*i])
		m.peerURL = loopbackURL("http", ports[2*i+1])
		peers[i] = name + "=" + m.peerURL.String()
		members[i] = m
	}
	fail := func(err error) error {
		for _, m := range members {
			m.Close()
		}
		return err
	}
	for _, m := range members {
		m.initialCluster = strings.Join(peers, ",")
		m.clusterToken = fmt.Sprintf("coordtest-%d", attempt)
		if err := m.start(); err != nil {
			return fail(err)
		}
	}
	// A member is ready once it has published itself through raft, which
	// needs a quorum: they become ready together.
	deadline := time.Now().Add(readyTimeout)
	for _, m := range members {
		if err := m.waitReady(deadline); err != nil {
			return fail(err)
		}
	}
	c.members = members
	return nil
}

func (c *ProcessCluster) cleanup() {
	c.closeClients()
	var wg sync.WaitGroup
	for _, m := range c.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.Close()
		}()
	}
	wg.Wait()
}

// Members returns the members, in the order of their names.
func (c *ProcessCluster) Members() []*Process { return slices.Clone(c.members) }

// ClientConfig is Server.ClientConfig with every member's client URL as an
// endpoint.
func (c *ProcessCluster) ClientConfig() clientv3.Config {
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = m.Endpoint()
	}
	return clientConfig(eps...)
}

// Client returns a client of all the members, shared by its callers and
// closed by the cluster's cleanup; see Cluster.Client.
func (c *ProcessCluster) Client() *clientv3.Client {
	c.t.Helper()
	return c.clientFor(c.t, c.ClientConfig(), "ProcessCluster", "the cluster")
}

// NewClient returns a new client of all the members, closed by a t.Cleanup
// or the cluster's cleanup.
func (c *ProcessCluster) NewClient(t testing.TB) *clientv3.Client {
	t.Helper()
	return newTestClient(t, c.ClientConfig(), c)
}

// Leader returns the member that leads with the support of a majority of
// the members, as their status says. It waits for one until ctx ends or
// 30 s have passed, and fails the test if there is none by then.
func (c *ProcessCluster) Leader(ctx context.Context) *Process {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(ctx, leaderTimeout)
	defer cancel()
	for {
		if l := c.leader(ctx); l != nil {
			return l
		}
		select {
		case <-ctx.Done():
			c.t.Fatalf("coordtest: no leader supported by a majority of the %d members: %v", len(c.members), ctx.Err())
			return nil
		case <-time.After(leaderPoll):
		}
	}
}

// leader is the member a majority of the members name as their leader and
// that names itself; nil if there is none now.
func (c *ProcessCluster) leader(ctx context.Context) *Process {
	cli, err := c.sharedClient(c.ClientConfig())
	if err != nil {
		return nil
	}
	votes := map[uint64]int{}
	byID := map[uint64]*Process{}
	for _, m := range c.members {
		if !m.running() {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, probeTimeout)
		st, err := cli.Status(sctx, m.Endpoint())
		cancel()
		if err != nil {
			continue
		}
		byID[st.Header.MemberId] = m
		if st.Leader != 0 {
			votes[st.Leader]++
		}
	}
	for id, n := range votes {
		if m := byID[id]; m != nil && n > len(c.members)/2 {
			return m
		}
	}
	return nil
}

// MoveLeader hands the raft leadership over to member to (through etcd's
// maintenance API, sent to the current leader) and waits until to leads.
// It fails the test if that does not happen within ctx or 30 s.
func (c *ProcessCluster) MoveLeader(ctx context.Context, to *Process) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(ctx, leaderTimeout)
	defer cancel()
	cli := c.Client()
	st, err := cli.Status(ctx, to.Endpoint())
	if err != nil {
		c.t.Fatalf("coordtest: reading the status of member %s: %v", to.name, err)
	}
	id := st.Header.MemberId
	for {
		l := c.Leader(ctx)
		if l == to {
			return
		}
		lcli, err := l.sharedClient(l.ClientConfig())
		if err == nil {
			_, err = lcli.MoveLeader(ctx, id)
		}
		if err != nil && !strings.Contains(err.Error(), "not leader") {
			c.t.Fatalf("coordtest: moving the leadership from %s to %s: %v", l.name, to.name, err)
		}
		select {
		case <-ctx.Done():
			c.t.Fatalf("coordtest: moving the leadership to %s: %v", to.name, ctx.Err())
		case <-time.After(leaderPoll):
		}
	}
}

// Compact compacts the store at its current revision, waits until the
// compaction is physically applied on the member that served it and
// applied on every other running member (each has answered a linearizable
// read since), and returns that revision. It fails the test on error.
func (c *ProcessCluster) Compact(ctx context.Context) int64 {
	c.t.Helper()
	rev, err := compactAt(ctx, c.Client())
	if err != nil {
		c.t.Fatalf("coordtest: %v", err)
	}
	for _, m := range c.members {
		if !m.running() {
			continue
		}
		if _, err := m.revision(ctx); err != nil {
			c.t.Fatalf("coordtest: waiting for member %s to apply the compaction at %d: %v", m.name, rev, err)
		}
	}
	return rev
}
