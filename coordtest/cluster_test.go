package coordtest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// isolateBound bounds how long the effects of a Stop or an Isolate may take
// to show. They take a few election timeouts (100 ms each); the bound is
// generous for slow emulation.
const isolateBound = 10 * time.Second

// putEventually writes key=val through c, retrying (with require-leader, so
// a member without a leader answers at once) until it succeeds or ctx ends.
func putEventually(ctx context.Context, c *clientv3.Client, key, val string) (*clientv3.PutResponse, error) {
	var resp *clientv3.PutResponse
	err := eventually(ctx, func(ctx context.Context) (err error) {
		resp, err = c.Put(clientv3.WithRequireLeader(ctx), key, val)
		return err
	})
	return resp, err
}

// leaderOtherThan waits, within isolateBound, for the leader of c, and fails
// the test if it is m, which is gone (stopped or isolated, as what says).
func leaderOtherThan(t *testing.T, ctx context.Context, c *Cluster, m *Member, what string) *Member {
	t.Helper()
	lctx, cancel := context.WithTimeout(ctx, isolateBound)
	defer cancel()
	l := c.Leader(lctx)
	if l == m {
		t.Fatalf("Leader() = %s member %s", what, m.Name())
	}
	return l
}

func TestClusterPutGet(t *testing.T) {
	ctx := testCtx(t)
	start := time.Now()
	c := NewCluster(t, 3)
	t.Logf("3-member cluster ready in %v", time.Since(start))

	ms := c.Members()
	if len(ms) != 3 {
		t.Fatalf("Members() has %d members, want 3", len(ms))
	}
	seen := make(map[string]bool)
	for i, m := range ms {
		if want := "m" + string(rune('0'+i)); m.Name() != want {
			t.Errorf("member %d: Name() = %q, want %q", i, m.Name(), want)
		}
		ep := m.Endpoint()
		if !strings.HasPrefix(ep, "http://127.0.0.1:") || seen[ep] {
			t.Errorf("member %s: Endpoint() = %q, want a distinct http://127.0.0.1:PORT", m.Name(), ep)
		}
		seen[ep] = true
	}
	if got := c.Client().Endpoints(); len(got) != 3 {
		t.Errorf("Client().Endpoints() = %v, want all 3 members", got)
	}
	if c.Client() != c.Client() {
		t.Error("Client() returned different clients")
	}

	mustPut(t, ctx, c.Client(), "k", "v")
	if got, err := getValue(ctx, c.Client(), "k"); err != nil || got != "v" {
		t.Fatalf("Get = %q, %v; want v", got, err)
	}
	other := c.NewClient(t)
	if other == c.Client() || len(other.Endpoints()) != 3 {
		t.Errorf("NewClient returned the shared client or not all endpoints: %v", other.Endpoints())
	}
	if got, err := getValue(ctx, other, "k"); err != nil || got != "v" {
		t.Fatalf("Get through NewClient = %q, %v; want v", got, err)
	}
	// Every member serves the write, linearizably.
	for _, m := range ms {
		pc := m.NewClient(t)
		if eps := pc.Endpoints(); len(eps) != 1 || eps[0] != m.Endpoint() {
			t.Errorf("member %s: NewClient endpoints %v, want only %s", m.Name(), eps, m.Endpoint())
		}
		if got, err := getValue(ctx, pc, "k"); err != nil || got != "v" {
			t.Fatalf("Get through member %s = %q, %v; want v", m.Name(), got, err)
		}
	}

	// The minimum lease TTL is 1 s, as with a Server.
	mustGrantTTL(t, ctx, c.Client(), 1, 1)
}

func TestClusterLeaderFailoverAndRestart(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(t, 3)
	cli := c.Client()

	old := c.Leader(ctx)
	if old == nil {
		t.Fatal("Leader() = nil")
	}
	pinned := old.NewClient(t) // survives the member's Stop and Restart
	mustPut(t, ctx, cli, "k", "before")

	start := time.Now()
	old.Stop()
	t.Logf("Stop of leader %s took %v", old.Name(), time.Since(start))
	old.Stop() // idempotent

	leader := leaderOtherThan(t, ctx, c, old, "stopped")
	t.Logf("new leader %s elected %v after the old one stopped", leader.Name(), time.Since(start))

	// Writes go on through the cluster client; requests it sends to the
	// stopped member fail until it skips that member.
	put, err := putEventually(ctx, cli, "k", "after")
	if err != nil {
		t.Fatalf("Put with a member stopped: %v", err)
	}
	t.Logf("cluster client wrote %v after the leader stopped", time.Since(start))

	sctx, scancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = pinned.Get(sctx, "k")
	scancel()
	if err == nil {
		t.Fatal("Get through the stopped member succeeded")
	}

	start = time.Now()
	old.Restart()
	t.Logf("Restart of %s (until rejoined) took %v", old.Name(), time.Since(start))
	// Rejoined: it serves the write made while it was down, linearizably.
	resp, err := pinned.Get(ctx, "k")
	if err != nil {
		t.Fatalf("Get through restarted member: %v", err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "after" || resp.Header.Revision < put.Header.Revision {
		t.Fatalf("Get through restarted member = %v (rev %d), want after (rev >= %d)", resp.Kvs, resp.Header.Revision, put.Header.Revision)
	}
	if l := c.Leader(ctx); l == nil {
		t.Fatal("no leader after Restart")
	}

	// Restart of a running member works as well.
	follower := c.Members()[0]
	if follower == c.Leader(ctx) {
		follower = c.Members()[1]
	}
	follower.Restart()
	if got, err := getValue(ctx, follower.NewClient(t), "k"); err != nil || got != "after" {
		t.Fatalf("Get through member %s after its Restart = %q, %v; want after", follower.Name(), got, err)
	}
}

// isNoLeader reports whether err is what a member without a leader answers
// a linearizable request with, or the client's deadline running out while
// it waits.
func isNoLeader(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, rpctypes.ErrNoLeader) ||
		errors.Is(err, rpctypes.ErrTimeout) ||
		errors.Is(err, rpctypes.ErrTimeoutDueToLeaderFail) ||
		errors.Is(err, rpctypes.ErrLeaderChanged)
}

func TestClusterIsolate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		leader bool
	}{
		{"follower", false},
		{"leader", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			c := NewCluster(t, 3)
			leader := c.Leader(ctx)
			m := leader
			if !tc.leader {
				for _, mm := range c.Members() {
					if mm != leader {
						m = mm
						break
					}
				}
			}
			pc := m.NewClient(t)
			mustPut(t, ctx, c.Client(), "k", "v1")
			if got, err := getValue(ctx, pc, "k"); err != nil || got != "v1" {
				t.Fatalf("Get through %s = %q, %v; want v1", m.Name(), got, err)
			}
			// A require-leader watch, known to be established.
			wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
			defer wcancel()
			wch := pc.Watch(wctx, "w", clientv3.WithCreatedNotify())
			if wr, ok := <-wch; !ok || !wr.Created {
				t.Fatalf("watch not created: %+v, %v", wr, ok)
			}

			start := time.Now()
			m.Isolate()
			m.Isolate() // idempotent

			// The others go on, with a leader of their own.
			nl := leaderOtherThan(t, ctx, c, m, "isolated")
			if tc.leader {
				t.Logf("new leader %s elected %v after isolating leader %s", nl.Name(), time.Since(start), m.Name())
			} else if nl != leader {
				t.Logf("leader changed from %s to %s after isolating follower %s", leader.Name(), nl.Name(), m.Name())
			}

			// The isolated member cannot serve linearizable reads...
			gctx, gcancel := context.WithTimeout(ctx, 500*time.Millisecond)
			_, err := pc.Get(gctx, "k")
			gcancel()
			if !isNoLeader(err) {
				t.Fatalf("linearizable Get through isolated %s: err = %v, want a timeout or no leader", m.Name(), err)
			}
			t.Logf("linearizable Get through isolated member: %v", err)
			// ...but clients still reach it.
			sresp, err := pc.Get(ctx, "k", clientv3.WithSerializable())
			if err != nil || len(sresp.Kvs) != 1 {
				t.Fatalf("serializable Get through isolated %s: %v, %v", m.Name(), sresp, err)
			}

			// Its require-leader watch is cancelled.
			timer := time.NewTimer(isolateBound)
			defer timer.Stop()
			select {
			case wr, ok := <-wch:
				// The watch ends with ErrNoLeader, or the channel closes.
				if ok && !errors.Is(wr.Err(), rpctypes.ErrNoLeader) {
					t.Fatalf("require-leader watch on isolated member got %+v, err %v; want ErrNoLeader", wr, wr.Err())
				}
				t.Logf("require-leader watch cancelled %v after Isolate (closed: %v)", time.Since(start), !ok)
			case <-timer.C:
				t.Fatalf("require-leader watch on isolated %s not cancelled within %v", m.Name(), isolateBound)
			}
			// By now it sees no leader.
			st, err := pc.Status(ctx, m.Endpoint())
			if err != nil {
				t.Fatalf("Status of isolated %s: %v", m.Name(), err)
			}
			if st.Leader != 0 {
				t.Errorf("isolated %s reports leader %x, want none", m.Name(), st.Leader)
			}

			// The others accept writes.
			put, err := putEventually(ctx, c.Client(), "k", "v2")
			if err != nil {
				t.Fatalf("Put through the cluster client with %s isolated: %v", m.Name(), err)
			}
			if got, err := getValue(ctx, nl.NewClient(t), "k"); err != nil || got != "v2" {
				t.Fatalf("Get through leader %s = %q, %v; want v2", nl.Name(), got, err)
			}
			// The isolated member has not seen the write.
			sresp, err = pc.Get(ctx, "k", clientv3.WithSerializable())
			if err != nil || len(sresp.Kvs) != 1 || string(sresp.Kvs[0].Value) != "v1" {
				t.Fatalf("serializable Get through isolated %s = %v, %v; want stale v1", m.Name(), sresp, err)
			}

			start = time.Now()
			m.Heal()
			m.Heal() // idempotent
			var resp *clientv3.GetResponse
			err = eventually(ctx, func(ctx context.Context) (err error) {
				resp, err = pc.Get(ctx, "k")
				return err
			})
			if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v2" || resp.Header.Revision < put.Header.Revision {
				t.Fatalf("linearizable Get through healed %s = %v, %v; want v2", m.Name(), resp, err)
			}
			t.Logf("healed member served a linearizable Get %v after Heal", time.Since(start))
			// And a new require-leader watch on it works.
			wch = pc.Watch(wctx, "w", clientv3.WithRev(put.Header.Revision))
			if _, err := putEventually(ctx, c.Client(), "w", "x"); err != nil {
				t.Fatalf("Put: %v", err)
			}
			if wr := <-wch; wr.Err() != nil || len(wr.Events) != 1 {
				t.Fatalf("require-leader watch on healed member: %+v, err %v", wr, wr.Err())
			}
		})
	}
}

// TestClusterIsolateStopRestart restarts an isolated member: it cannot
// rejoin until healed.
func TestClusterIsolateStopRestart(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(t, 3)
	m := c.Members()[2]
	pc := m.NewClient(t)
	m.Isolate()
	m.Stop()
	m.Restart() // returns once started
	put, err := putEventually(ctx, c.Client(), "k", "v")
	if err != nil {
		t.Fatalf("Put: %v", err)
	}
	gctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = pc.Get(gctx, "k")
	cancel()
	if !isNoLeader(err) {
		t.Fatalf("linearizable Get through isolated restarted member: err = %v, want a timeout or no leader", err)
	}
	m.Heal()
	var resp *clientv3.GetResponse
	err = eventually(ctx, func(ctx context.Context) (err error) {
		resp, err = pc.Get(ctx, "k")
		return err
	})
	if err != nil || len(resp.Kvs) != 1 || resp.Header.Revision < put.Header.Revision {
		t.Fatalf("Get through healed member = %v, %v; want v", resp, err)
	}
}

func TestClusterCompact(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(t, 3)
	first := mustPut(t, ctx, c.Client(), "k", "1")
	last := mustPut(t, ctx, c.Client(), "k", "2")
	rev := c.Compact(ctx)
	if rev != last.Header.Revision {
		t.Fatalf("Compact() = %d, want %d", rev, last.Header.Revision)
	}
	if again := c.Compact(ctx); again != rev {
		t.Fatalf("second Compact() = %d, want %d", again, rev)
	}
	for _, m := range c.Members() {
		_, err := m.NewClient(t).Get(ctx, "k", clientv3.WithRev(first.Header.Revision), clientv3.WithSerializable())
		if !errors.Is(err, rpctypes.ErrCompacted) {
			t.Errorf("member %s: Get at compacted revision: err = %v, want ErrCompacted", m.Name(), err)
		}
	}
}

func TestClusterMemberProxy(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(t, 3)
	m := c.Members()[1]
	p := m.NewProxy(t)
	pc := p.NewClient(t)
	mustPut(t, ctx, pc, "k", "v")
	p.Blackhole()
	expectNoAnswer(t, ctx, pc, 300*time.Millisecond)
	p.Unblackhole()
	start := time.Now()
	m.Restart()
	waitValue(t, ctx, pc, "k", "v", "through proxy after Unblackhole and Restart")
	t.Logf("proxy client usable %v after Unblackhole and Restart", time.Since(start))
}

func TestNewClusterWith(t *testing.T) {
	ctx := testCtx(t)
	c := NewClusterWith(t, 1, Config{TickMs: 20})
	if n := len(c.Members()); n != 1 {
		t.Fatalf("Members() has %d members, want 1", n)
	}
	if c.Leader(ctx) != c.Members()[0] {
		t.Fatal("the single member is not the leader")
	}
	mustGrantTTL(t, ctx, c.Client(), 1, 1)
}
