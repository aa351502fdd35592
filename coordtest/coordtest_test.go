package coordtest

import (
	"context"
	"errors"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(selfEtcdEnv) != "" {
		// etcd refuses to run on a GOARCH it does not support (riscv64,
		// loong64) unless told to: this binary is built for the target
		// the tests run on.
		os.Setenv("ETCD_UNSUPPORTED_ARCH", runtime.GOARCH)
		etcdmain.Main(os.Args) // exits
	}
	// The processes the tests start run this binary as etcd.
	os.Setenv(selfEtcdEnv, "1")
	goleak.VerifyTestMain(m)
}

// testCtx returns a context bounded by a generous deadline, cancelled at the
// end of the test.
func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// eventually calls f with a short per-attempt deadline until it succeeds or
// ctx ends, and returns the last error.
func eventually(ctx context.Context, f func(ctx context.Context) error) error {
	for {
		actx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		err := f(actx)
		cancel()
		if err == nil || ctx.Err() != nil {
			return err
		}
	}
}

func getValue(ctx context.Context, c *clientv3.Client, key string) (string, error) {
	resp, err := c.Get(ctx, key)
	if err != nil {
		return "", err
	}
	if len(resp.Kvs) != 1 {
		return "", errors.New("key " + key + " not found")
	}
	return string(resp.Kvs[0].Value), nil
}

// mustPut writes key=val through c, failing the test on error.
func mustPut(t *testing.T, ctx context.Context, c *clientv3.Client, key, val string) *clientv3.PutResponse {
	t.Helper()
	resp, err := c.Put(ctx, key, val)
	if err != nil {
		t.Fatalf("Put %s=%s through %v: %v", key, val, c.Endpoints(), err)
	}
	return resp
}

// mustGrantTTL grants a lease of ttl seconds through c and fails the test
// unless etcd gives it the TTL want (its minimum TTL shows here).
func mustGrantTTL(t *testing.T, ctx context.Context, c *clientv3.Client, ttl, want int64) {
	t.Helper()
	resp, err := c.Grant(ctx, ttl)
	if err != nil {
		t.Fatalf("Grant(%d): %v", ttl, err)
	}
	if resp.TTL != want {
		t.Fatalf("Grant(%d).TTL = %d, want %d (minimum TTL too large?)", ttl, resp.TTL, want)
	}
}

// waitValue reads key through c until that succeeds or ctx ends, and fails
// the test unless it reads want. when says when, for the failure message:
// "after Restart".
func waitValue(t *testing.T, ctx context.Context, c *clientv3.Client, key, want, when string) {
	t.Helper()
	var got string
	err := eventually(ctx, func(ctx context.Context) (err error) {
		got, err = getValue(ctx, c, key)
		return err
	})
	if err != nil || got != want {
		t.Fatalf("Get %s = %q, %v; want %q", when, got, err, want)
	}
}

// expectNoAnswer checks that a Get through c, a client of a blackholed
// proxy, gets no answer within d.
func expectNoAnswer(t *testing.T, ctx context.Context, c *clientv3.Client, d time.Duration) {
	t.Helper()
	gctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	if _, err := c.Get(gctx, "k"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get through a blackholed proxy: err = %v, want context.DeadlineExceeded", err)
	}
}

// newProxied starts a Server and a Proxy in front of it, and returns them
// with a client through the proxy.
func newProxied(t *testing.T) (*Server, *Proxy, *clientv3.Client) {
	t.Helper()
	s := NewServer(t)
	p := s.NewProxy(t)
	return s, p, p.NewClient(t)
}

// newProxiedKV is newProxied, with k=v written through the proxy's client.
func newProxiedKV(t *testing.T, ctx context.Context) (*Server, *Proxy, *clientv3.Client) {
	t.Helper()
	s, p, pc := newProxied(t)
	mustPut(t, ctx, pc, "k", "v")
	return s, p, pc
}

func TestPutGet(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	if ep := s.Endpoint(); !strings.HasPrefix(ep, "http://127.0.0.1:") {
		t.Errorf("Endpoint() = %q, want http://127.0.0.1:PORT", ep)
	}
	if s.Client() != s.Client() {
		t.Error("Client() returned different clients")
	}
	mustPut(t, ctx, s.Client(), "k", "v")
	other := s.NewClient(t)
	if other == s.Client() {
		t.Error("NewClient returned the shared client")
	}
	if got, err := getValue(ctx, other, "k"); err != nil || got != "v" {
		t.Fatalf("Get = %q, %v; want v", got, err)
	}
	// A user-built client from ClientConfig works too.
	mine, err := clientv3.New(s.ClientConfig())
	if err != nil {
		t.Fatalf("clientv3.New: %v", err)
	}
	defer mine.Close()
	if got, err := getValue(ctx, mine, "k"); err != nil || got != "v" {
		t.Fatalf("Get = %q, %v; want v", got, err)
	}
	// Closing a NewClient client early is harmless; cleanup closes it again.
	if err := other.Close(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Close: %v", err)
	}
}

func TestMinimumLeaseTTL(t *testing.T) {
	ctx := testCtx(t)
	mustGrantTTL(t, ctx, NewServer(t).Client(), 1, 1)
}

func TestRevisionAndCompact(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	c := s.Client()
	first := mustPut(t, ctx, c, "k", "1")
	old := first.Header.Revision
	last := mustPut(t, ctx, c, "k", "2")
	if got := s.Revision(ctx); got != last.Header.Revision {
		t.Fatalf("Revision() = %d, want %d", got, last.Header.Revision)
	}
	rev := s.Compact(ctx)
	if rev != last.Header.Revision {
		t.Fatalf("Compact() = %d, want %d", rev, last.Header.Revision)
	}
	if again := s.Compact(ctx); again != rev {
		t.Fatalf("second Compact() = %d, want %d", again, rev)
	}

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wresp, ok := <-c.Watch(wctx, "k", clientv3.WithRev(old))
	if !ok {
		t.Fatal("watch channel closed without a response")
	}
	if !errors.Is(wresp.Err(), rpctypes.ErrCompacted) {
		t.Fatalf("watch from compacted revision %d: err = %v, want ErrCompacted", old, wresp.Err())
	}
	if wresp.CompactRevision != rev {
		t.Errorf("CompactRevision = %d, want %d", wresp.CompactRevision, rev)
	}
	if _, err := c.Get(ctx, "k", clientv3.WithRev(old)); !errors.Is(err, rpctypes.ErrCompacted) {
		t.Errorf("Get at compacted revision: err = %v, want ErrCompacted", err)
	}
}

func TestStopRestart(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	c := s.NewClient(t)
	put := mustPut(t, ctx, c, "k", "v")
	// A watch open across the restart must survive it: Stop reports
	// Unavailable, which the client retries, rather than cancelling it.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wch := c.Watch(wctx, "w", clientv3.WithRev(put.Header.Revision+1))

	start := time.Now()
	s.Stop()
	// Without aborting the open watch stream, etcd's graceful shutdown
	// would wait for its request timeout (5 s + 2 election timeouts).
	if d := time.Since(start); d >= 5*time.Second {
		t.Errorf("Stop with an open watch took %v, want well under 5s", d)
	} else {
		t.Logf("Stop with an open watch took %v", d)
	}
	s.Stop() // idempotent

	sctx, scancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err := c.Get(sctx, "k")
	scancel()
	if err == nil {
		t.Fatal("Get succeeded while the server is stopped")
	}

	start = time.Now()
	s.Restart()
	t.Logf("Restart took %v", time.Since(start))

	waitValue(t, ctx, c, "k", "v", "after Restart")
	t.Logf("existing client usable %v after Restart began", time.Since(start))
	if rev := s.Revision(ctx); rev != put.Header.Revision {
		t.Errorf("Revision after Restart = %d, want %d", rev, put.Header.Revision)
	}

	mustPut(t, ctx, s.Client(), "w", "x")
	select {
	case wresp := <-wch:
		if err := wresp.Err(); err != nil || len(wresp.Events) != 1 {
			t.Fatalf("watch after Restart: %+v, err %v; want one event", wresp, err)
		}
	case <-ctx.Done():
		t.Fatal("watch opened before Restart saw no event after it")
	}

	// Restart of a running server works as well.
	s.Restart()
	mustPut(t, ctx, s.Client(), "k", "v2")
}

func TestReplaceAndReset(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	c := s.NewClient(t)
	for range 5 {
		mustPut(t, ctx, c, "k", "v")
	}
	// Each time, the same client reaches the new etcd (it retries a read
	// while it reconnects), which holds nothing and counts its revisions
	// from the start again; Replace makes another cluster, Reset the same.
	before, err := c.Get(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		name    string
		do      func()
		renamed bool
	}{{"Replace", s.Replace, true}, {"Reset", s.Reset, false}} {
		mustPut(t, ctx, c, "k", "v")
		rev := s.Revision(ctx)
		step.do()
		resp, err := c.Get(ctx, "k")
		if err != nil {
			t.Fatalf("Get after %s: %v", step.name, err)
		}
		if len(resp.Kvs) != 0 || resp.Header.Revision >= rev {
			t.Fatalf("after %s: %d keys at revision %d, want none, below revision %d", step.name, len(resp.Kvs), resp.Header.Revision, rev)
		}
		if renamed := resp.Header.ClusterId != before.Header.ClusterId; renamed != step.renamed {
			t.Fatalf("after %s: cluster %x, before %x", step.name, resp.Header.ClusterId, before.Header.ClusterId)
		}
		before = resp
	}
}

func TestSnapshotRestore(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	c := s.NewClient(t)
	mustPut(t, ctx, c, "k", "v1")
	snap := s.Snapshot(ctx)
	at := s.Revision(ctx)
	for range 5 {
		mustPut(t, ctx, c, "k", "v2")
	}
	for _, bump := range []int64{0, 1000} {
		s.Restore(snap, uint64(bump))
		resp, err := c.Get(ctx, "k")
		if err != nil {
			t.Fatalf("Get after Restore (bump %d): %v", bump, err)
		}
		if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v1" || resp.Header.Revision != at+bump {
			t.Fatalf("after Restore (bump %d): %v at revision %d, want v1 at %d", bump, resp.Kvs, resp.Header.Revision, at+bump)
		}
	}
	// The bump marks the restored revision compacted: a watch from before
	// it is told so.
	wresp := <-c.Watch(ctx, "k", clientv3.WithRev(at+1))
	if !errors.Is(wresp.Err(), rpctypes.ErrCompacted) {
		t.Fatalf("a watch from revision %d after a bumped restore: %v, want compacted", at+1, wresp.Err())
	}
}

func TestRestartWaitsForBusyPort(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	s.Stop()
	// Occupy the client port for a while, as a lingering socket might.
	host := strings.TrimPrefix(s.Endpoint(), "http://")
	l, err := net.Listen("tcp", host)
	if err != nil {
		t.Fatalf("occupying %s: %v", host, err)
	}
	release := time.AfterFunc(300*time.Millisecond, func() { l.Close() })
	defer release.Stop()
	s.Restart()
	mustPut(t, ctx, s.Client(), "k", "v")
}

func TestProxyBlackhole(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	p := s.NewProxy(t)
	if p.Endpoint() == s.Endpoint() || !strings.HasPrefix(p.Endpoint(), "http://127.0.0.1:") {
		t.Errorf("proxy Endpoint() = %q", p.Endpoint())
	}
	pc := p.NewClient(t)
	direct := s.Client()
	mustPut(t, ctx, pc, "k", "v")

	p.Blackhole()
	expectNoAnswer(t, ctx, pc, 300*time.Millisecond)
	if got, err := getValue(ctx, direct, "k"); err != nil || got != "v" {
		t.Fatalf("direct Get during blackhole = %q, %v; want v", got, err)
	}

	p.Unblackhole()
	start := time.Now()
	waitValue(t, ctx, pc, "k", "v", "through proxy after Unblackhole")
	t.Logf("proxy client usable %v after Unblackhole", time.Since(start))
}

func TestProxyPause(t *testing.T) {
	ctx := testCtx(t)
	s, p, pc := newProxiedKV(t, ctx)

	p.Pause()
	type result struct {
		resp *clientv3.PutResponse
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := pc.Put(ctx, "k", "held")
		done <- result{resp, err}
	}()
	// The Put is held, not lost: it is not applied while paused...
	pctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	select {
	case r := <-done:
		t.Fatalf("Put through paused proxy completed: %v, %v", r.resp, r.err)
	case <-pctx.Done():
	}
	cancel()
	if got, err := getValue(ctx, s.Client(), "k"); err != nil || got != "v" {
		t.Fatalf("direct Get during pause = %q, %v; want v", got, err)
	}
	// ...and is delivered on the same connection after Unpause.
	p.Unpause()
	if r := <-done; r.err != nil {
		t.Fatalf("held Put after Unpause: %v", r.err)
	}
	if got, err := getValue(ctx, s.Client(), "k"); err != nil || got != "held" {
		t.Fatalf("Get after Unpause = %q, %v; want held", got, err)
	}
}

func TestProxySurvivesRestart(t *testing.T) {
	ctx := testCtx(t)
	s, _, pc := newProxiedKV(t, ctx)
	s.Restart()
	waitValue(t, ctx, pc, "k", "v", "through proxy after Restart")
}

// TestCleanupScopes checks that clients and proxies tied to a subtest are
// released at its end while the server lives on, and that a proxy client
// tied to the outer test does not keep its subtest proxy from closing.
func TestCleanupScopes(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	outerT := t
	t.Run("sub", func(t *testing.T) {
		p := s.NewProxy(t)
		outer := p.NewClient(outerT) // closed early, with the proxy
		mustPut(t, ctx, outer, "k", "v")
		_ = s.NewClient(t)
		_ = p.NewClient(t)
	})
	if got, err := getValue(ctx, s.Client(), "k"); err != nil || got != "v" {
		t.Fatalf("Get after subtest = %q, %v; want v", got, err)
	}
}

func TestConcurrentUse(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := s.Client()
			for j := 0; j < 10; j++ {
				// Puts in flight when Restart stops the server fail with
				// Unavailable; that is expected.
				if _, err := c.Put(ctx, "k", "v"); err != nil {
					t.Logf("Put racing with Restart: %v", err)
				}
				_ = s.Revision(ctx)
			}
			_ = s.NewClient(t)
			_ = s.ClientConfig()
			_ = s.Endpoint()
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.Restart()
	}()
	wg.Wait()
	mustPut(t, ctx, s.Client(), "k", "v")
}

func TestNewServerWith(t *testing.T) {
	ctx := testCtx(t)
	s := NewServerWith(t, Config{TickMs: 20})
	// ElectionMs defaults to 10*TickMs = 200 ms: minimum TTL still 1 s.
	mustGrantTTL(t, ctx, s.Client(), 1, 1)
	mustGrantTTL(t, ctx, s.Client(), 0, 1)
}
