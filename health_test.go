package coord

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// checkFunc is a Checker made of a function.
type checkFunc func() error

func (f checkFunc) Healthy() error { return f() }

// htGet requests url from h and returns the status and body.
func htGet(t *testing.T, h http.Handler, method, url string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, url, nil))
	body, _ := io.ReadAll(rec.Body)
	return rec.Code, string(body)
}

func TestHealthHandler(t *testing.T) {
	ok := checkFunc(func() error { return nil })
	bad := checkFunc(func() error { return errors.New("coord: lease 1: renewals unanswered\nfor 2s") })
	t.Run("answers 200 ok when every check is healthy", func(t *testing.T) {
		h := HealthHandler(map[string]Checker{"b": ok, "a": ok})
		if code, body := htGet(t, h, http.MethodGet, "/readyz"); code != http.StatusOK || body != "ok\n" {
			t.Fatalf("got %d %q", code, body)
		}
		if code, body := htGet(t, HealthHandler(nil), http.MethodHead, "/readyz"); code != http.StatusOK || body != "ok\n" {
			t.Fatalf("no checks: got %d %q", code, body)
		}
	})
	t.Run("answers 503 with a line per failing check, by name", func(t *testing.T) {
		h := HealthHandler(map[string]Checker{"z": bad, "ok": ok, "a": bad})
		want := "a: coord: lease 1: renewals unanswered for 2s\nz: coord: lease 1: renewals unanswered for 2s\n"
		if code, body := htGet(t, h, http.MethodGet, "/readyz"); code != http.StatusServiceUnavailable || body != want {
			t.Fatalf("got %d %q, want 503 %q", code, body, want)
		}
	})
	t.Run("lists every check with ?verbose", func(t *testing.T) {
		h := HealthHandler(map[string]Checker{"watcher": ok, "election": bad})
		want := "[-]election failed: coord: lease 1: renewals unanswered for 2s\n[+]watcher ok\nhealthz check failed\n"
		if code, body := htGet(t, h, http.MethodGet, "/readyz?verbose"); code != http.StatusServiceUnavailable || body != want {
			t.Fatalf("got %d %q, want 503 %q", code, body, want)
		}
		h = HealthHandler(map[string]Checker{"watcher": ok, "election": ok})
		want = "[+]election ok\n[+]watcher ok\nhealthz check passed\n"
		if code, body := htGet(t, h, http.MethodGet, "/readyz?verbose=1"); code != http.StatusOK || body != want {
			t.Fatalf("got %d %q, want 200 %q", code, body, want)
		}
	})
	t.Run("counts a check that panics, or is nil, as failing", func(t *testing.T) {
		h := HealthHandler(map[string]Checker{"boom": checkFunc(func() error { panic("no state") }), "nil": nil, "ok": ok})
		code, body := htGet(t, h, http.MethodGet, "/")
		if want := "boom: panic: no state\nnil: no checker (nil)\n"; code != http.StatusServiceUnavailable || body != want {
			t.Fatalf("got %d %q", code, body)
		}
	})
	t.Run("bounds a check that blocks, which ends with its check", func(t *testing.T) {
		unblock, returned := make(chan struct{}), make(chan struct{})
		stuck := checkFunc(func() error {
			defer close(returned)
			<-unblock
			return nil
		})
		h := HealthHandler(map[string]Checker{"stuck": stuck, "ok": ok})
		start := time.Now()
		code, body := htGet(t, h, http.MethodGet, "/?verbose")
		if took := time.Since(start); took < checkTimeout || took > patience() {
			t.Fatalf("answered after %v, want about %v", took, checkTimeout)
		}
		want := "[+]ok ok\n[-]stuck failed: timed out after 1s\nhealthz check failed\n"
		if code != http.StatusServiceUnavailable || body != want {
			t.Fatalf("got %d %q, want 503 %q", code, body, want)
		}
		close(unblock)
		waitClosed(t, returned, "the blocked check")
	})
	t.Run("refuses other methods than GET and HEAD", func(t *testing.T) {
		rec := httptest.NewRecorder()
		HealthHandler(nil).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/", nil))
		if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != "GET, HEAD" {
			t.Fatalf("got %d, Allow %q", rec.Code, rec.Header().Get("Allow"))
		}
	})
}

// htGate is a slog.Handler that holds the goroutine logging msg, the
// first time, until open: a way to keep the library in the state it is in
// when it says so.
type htGate struct {
	msg     string
	reached chan struct{} // closed when msg is logged
	release chan struct{} // closed by open
	first   sync.Once
	opened  sync.Once
}

func newHtGate(t *testing.T, msg string) (*htGate, *slog.Logger) {
	g := &htGate{msg: msg, reached: make(chan struct{}), release: make(chan struct{})}
	return g, slog.New(g)
}

func (g *htGate) Enabled(context.Context, slog.Level) bool { return true }
func (g *htGate) WithAttrs([]slog.Attr) slog.Handler       { return g }
func (g *htGate) WithGroup(string) slog.Handler            { return g }
func (g *htGate) Handle(_ context.Context, r slog.Record) error {
	if r.Message != g.msg {
		return nil
	}
	held := false
	g.first.Do(func() { held = true; close(g.reached) })
	if held {
		<-g.release
	}
	return nil
}

// open lets the held goroutine go on; idempotent.
func (g *htGate) open() { g.opened.Do(func() { close(g.release) }) }

// htUnhealthy waits until c is unhealthy with an error containing want.
func htUnhealthy(t *testing.T, c Checker, want string) error {
	t.Helper()
	var err error
	eventually(t, "Healthy to say "+want, func() bool {
		err = c.Healthy()
		return err != nil && strings.Contains(err.Error(), want)
	})
	if n := strings.Count(err.Error(), "coord:"); n != 1 {
		t.Fatalf("%q says coord: %d times", err, n)
	}
	return err
}

// htHealthy waits until c is healthy.
func htHealthy(t *testing.T, c Checker) {
	t.Helper()
	var err error
	eventually(t, "Healthy to return nil", func() bool {
		err = c.Healthy()
		return err == nil
	})
}

// htStayHealthy checks that c is healthy now.
func htStayHealthy(t *testing.T, c Checker) {
	t.Helper()
	if err := c.Healthy(); err != nil {
		t.Fatalf("Healthy: %v", err)
	}
}

func TestHealthHostLiveness(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("goes unhealthy while cut off and heals with the registration", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		h := register(t, px.NewClient(t), "a", LivenessOptions{TTL: 3 * time.Second * scale})
		htStayHealthy(t, h)
		px.Blackhole()
		cut := time.Now()
		err := htUnhealthy(t, h, "no renewal answered for")
		if d := time.Since(cut); d < h.TTL()/2-h.TTL()/3 {
			t.Fatalf("unhealthy %v after the cut: %v", d, err)
		}
		t.Logf("%v after the cut: %v", time.Since(cut), err)
		// The lease expires meanwhile: the registration heals once the
		// link does.
		old := h.LeaseID()
		eventually(t, "the lease to expire", func() bool { return etTTL(t, cli, old) == -1 })
		px.Unblackhole()
		htHealthy(t, h)
		if h.LeaseID() == old {
			t.Fatal("healthy on the old lease")
		}
	})
	t.Run("judges renewals unanswered a third of the TTL and a second after the last answered, half the TTL up to 6 s", func(t *testing.T) {
		_, cli := newEtcd(t)
		for _, c := range []struct{ ttl, bound time.Duration }{{3 * time.Second, 1500 * time.Millisecond}, {9 * time.Second, 4 * time.Second}} {
			h := register(t, cli, "a-"+c.ttl.String(), LivenessOptions{TTL: c.ttl})
			var k *keeper
			eventually(t, "a keeper renewing the lease", func() bool {
				h.mu.Lock()
				defer h.mu.Unlock()
				k = h.keep
				return k != nil
			})
			// Judged on one last answer: again if a renewal was answered
			// meanwhile.
			var at, past error
			for {
				last := k.lastAnswer()
				at, past = k.unanswered(last.Add(c.bound)), k.unanswered(last.Add(c.bound+time.Millisecond))
				if last.Equal(k.lastAnswer()) {
					break
				}
			}
			if at != nil || past == nil {
				t.Fatalf("TTL %v: %v after the last answered renewal: %v; a millisecond later: %v", c.ttl, c.bound, at, past)
			}
		}
	})
	t.Run("is unhealthy while it heals, saying since when", func(t *testing.T) {
		_, cli := newEtcd(t)
		g, log := newHtGate(t, "coord: host registration lost, healing")
		h := register(t, cli, "a", LivenessOptions{TTL: 2 * time.Second, Logger: log})
		t.Cleanup(g.open)
		htStayHealthy(t, h)
		if _, err := cli.Revoke(testCtx(t), h.LeaseID()); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, g.reached, "the heal")
		err := htUnhealthy(t, h, "registration lost")
		if !strings.Contains(err.Error(), "ago, healing") {
			t.Fatalf("Healthy: %v", err)
		}
		g.open()
		htHealthy(t, h)
	})
	t.Run("says why once the registration ended, and stopped after Stop", func(t *testing.T) {
		_, cli := newEtcd(t)
		h := register(t, cli, "a", LivenessOptions{})
		register(t, cli, "a", LivenessOptions{Takeover: true})
		waitClosed(t, h.Done(), "Done of the registration taken over")
		err := htUnhealthy(t, h, `coord: host "a": registration ended: host already registered`)
		if !errors.Is(err, ErrHostExists) {
			t.Fatalf("Healthy: %v, want it to wrap ErrHostExists", err)
		}
		h.Stop(testCtx(t))
		htUnhealthy(t, h, "registration ended")

		h2 := register(t, cli, "b", LivenessOptions{})
		if err := h2.Stop(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if err := h2.Healthy(); err == nil || err.Error() != `coord: host "b": stopped` {
			t.Fatalf("Healthy after Stop: %v", err)
		}
	})
}

func TestHealthHostWatcher(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("is healthy once synced, unhealthy past the bound until then", func(t *testing.T) {
		srv, _ := newEtcd(t)
		px := srv.NewProxy(t)
		c := px.NewClient(t)
		px.Blackhole()
		w, err := NewHostWatcher(testCtx(t), c, WatcherOptions{Prefix: prefixFor(t), UnhealthyAfter: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		htUnhealthy(t, w, "not synced for")
		px.Unblackhole()
		htHealthy(t, w)
	})
	t.Run("is unhealthy past the bound while it lists again after a broken watch", func(t *testing.T) {
		srv, cli := newEtcd(t)
		prefix := prefixFor(t)
		px := srv.NewProxy(t)
		g, log := newHtGate(t, "coord: host watch broke, resyncing")
		w, err := NewHostWatcher(testCtx(t), px.NewClient(t), WatcherOptions{Prefix: prefix, Logger: log, UnhealthyAfter: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		t.Cleanup(g.open)
		htHealthy(t, w)
		quiet(t, cli, w, prefix) // the watch runs
		htBreakWatch(t, srv, cli, px, prefix)
		waitClosed(t, g.reached, "the broken watch")
		htUnhealthy(t, w, "watch broken for")
		g.open()
		htHealthy(t, w)
	})
	t.Run("is unhealthy once its watch hears nothing from etcd, and heals", func(t *testing.T) {
		// A quiet watch stays healthy past the bound: etcd is asked
		// where it stands. Cut off silently, nothing answers.
		srv, cli := newEtcd(t)
		prefix := prefixFor(t)
		px := srv.NewProxy(t)
		bound := time.Second * scale
		w, err := NewHostWatcher(testCtx(t), px.NewClient(t), WatcherOptions{Prefix: prefix, UnhealthyAfter: bound})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		quiet(t, cli, w, prefix) // the watch runs
		last := time.Now()
		eventually(t, "word from etcd past the bound, with no event", func() bool {
			w.mu.Lock()
			defer w.mu.Unlock()
			return w.heard.Sub(last) > bound
		})
		htStayHealthy(t, w)
		px.Blackhole()
		cut := time.Now()
		err = htUnhealthy(t, w, "no word from etcd on the watch for")
		t.Logf("%v after the cut: %v", time.Since(cut).Round(time.Millisecond), err)
		px.Unblackhole()
		htHealthy(t, w)
	})
	t.Run("is closed after Close, and says why it ended by itself", func(t *testing.T) {
		srv, cli := newEtcd(t)
		w := wtWatch(t, testCtx(t), cli, WatcherOptions{Prefix: prefixFor(t)})
		htHealthy(t, w)
		w.Close()
		if err := w.Healthy(); err == nil || !strings.HasSuffix(err.Error(), ": closed") {
			t.Fatalf("Healthy after Close: %v", err)
		}
		c := srv.NewClient(t)
		w2 := wtWatch(t, testCtx(t), c, WatcherOptions{Prefix: prefixFor(t)})
		htHealthy(t, w2)
		c.Close()
		w2.Wait()
		htUnhealthy(t, w2, "ended: watch hosts under")
	})
	t.Run("refuses a negative bound", func(t *testing.T) {
		_, cli := newEtcd(t)
		if _, err := NewHostWatcher(testCtx(t), cli, WatcherOptions{UnhealthyAfter: -time.Second}); !errors.Is(err, ErrInvalidTTL) {
			t.Fatalf("got %v, want ErrInvalidTTL", err)
		}
	})
}

// htBreakWatch breaks the watches of the clients behind px: events are
// dropped, then compacted away, so that the watches, created again from
// where they were, are refused (see the watcher's compaction tests).
func htBreakWatch(t *testing.T, srv interface {
	Stop()
	Restart()
	Compact(context.Context) int64
}, cli *clientv3.Client, px interface {
	Blackhole()
	Unblackhole()
}, prefix string) {
	t.Helper()
	px.Blackhole()
	for _, k := range []string{"x", "y"} {
		if _, err := cli.Put(testCtx(t), prefix+k, "{}"); err != nil {
			t.Fatal(err)
		}
	}
	srv.Compact(testCtx(t))
	srv.Stop()
	px.Unblackhole()
	srv.Restart()
}

func TestHealthElection(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("a standby cut off goes unhealthy, then without a session, and heals", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		ttl := 2 * time.Second * scale
		a := etElection(t, cli, ElectionOptions{TTL: ttl})
		b := etElection(t, px.NewClient(t), ElectionOptions{TTL: ttl})
		htStayHealthy(t, b) // it never campaigned
		etCampaign(t, a, "a")
		etQueue(t, testCtx(t), cli, b)
		htStayHealthy(t, a)
		htStayHealthy(t, b) // waiting in line
		px.Blackhole()
		htUnhealthy(t, b, "no renewal answered for")
		htUnhealthy(t, b, "no session granted for")
		htStayHealthy(t, a)
		px.Unblackhole()
		htHealthy(t, b)
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
	})
	t.Run("a leader cut off is unhealthy until it steps down", func(t *testing.T) {
		srv, _ := newEtcd(t)
		px := srv.NewProxy(t)
		a := etElection(t, px.NewClient(t), ElectionOptions{TTL: 3 * time.Second * scale})
		etCampaign(t, a, "a")
		done := a.Done()
		px.Blackhole()
		htUnhealthy(t, a, `coord: election "`+etKey+`": lease`)
		if isClosed(done) {
			t.Fatal("unhealthy only once stepped down")
		}
		waitClosed(t, done, "Done of the leader cut off")
		// It no longer campaigns: nothing is wrong with what it does.
		htHealthy(t, a)
		px.Unblackhole()
	})
	t.Run("is closed after Close or once its client is", func(t *testing.T) {
		srv, cli := newEtcd(t)
		a := etElection(t, cli, ElectionOptions{})
		a.Close()
		if err := a.Healthy(); err == nil || err.Error() != `coord: election "`+etKey+`": closed` {
			t.Fatalf("Healthy after Close: %v", err)
		}
		c := srv.NewClient(t)
		b := etElection(t, c, ElectionOptions{})
		c.Close()
		if err := b.Healthy(); !errors.Is(err, ErrClientClosed) {
			t.Fatalf("Healthy once the client is closed: %v", err)
		}
	})
}

func TestHealthElectionPool(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("names the elections that cannot get a session", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		p := ptPool(t, px.NewClient(t), PoolOptions{TTL: 2 * time.Second * scale})
		htStayHealthy(t, p)
		idle := ptElection(t, p, "/pool/idle")
		e := ptElection(t, p, "/pool/e")
		px.Blackhole()
		res := etCampaignAsync(testCtx(t), e, "e")
		eventually(t, "the campaign to ask for a session", func() bool {
			e.mu.Lock()
			defer e.mu.Unlock()
			return !e.granting.IsZero()
		})
		htStayHealthy(t, p) // no session yet, for less than the TTL
		err := htUnhealthy(t, p, `coord: election pool: 1 of 2 elections unhealthy, first election "/pool/e": no session granted for`)
		t.Log(err)
		htStayHealthy(t, idle)
		px.Unblackhole()
		if r := etWait(t, res); r.err != nil {
			t.Fatalf("Campaign: %v", r.err)
		}
		htHealthy(t, p)
		etWaitCount(t, cli, "/pool/e/", 1, clientv3.WithPrefix())
		p.Close()
		if err := p.Healthy(); err == nil || err.Error() != "coord: election pool: closed" {
			t.Fatalf("Healthy after Close: %v", err)
		}
	})
}

func TestHealthSemaphore(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("a waiter cut off goes unhealthy and heals; a holder until its permit is lost", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		// The holder is unhealthy for a sixth of the TTL before its
		// permit ends.
		ttl := 3 * time.Second * scale
		a := smSemaphore(t, cli, SemaphoreOptions{Limit: 1, TTL: ttl})
		b := smSemaphore(t, px.NewClient(t), SemaphoreOptions{Limit: 1, TTL: ttl})
		htStayHealthy(t, b) // idle
		held := smAcquire(t, a)
		res := smQueue(t, testCtx(t), cli, b, 2)
		htStayHealthy(t, b) // waiting in line
		px.Blackhole()
		htUnhealthy(t, b, "no renewal answered for")
		htUnhealthy(t, b, "no session granted for")
		px.Unblackhole()
		htHealthy(t, b)
		smRelease(t, cli, held)
		p := smGot(t, res).p
		htStayHealthy(t, b) // holding
		px.Blackhole()
		htUnhealthy(t, b, `coord: semaphore "`+smKey+`": lease`)
		waitClosed(t, p.Done(), "Done of the permit cut off")
		htHealthy(t, b) // nothing held, nothing asked
		px.Unblackhole()
	})
	t.Run("is closed after Close or once its client is", func(t *testing.T) {
		srv, cli := newEtcd(t)
		s := smSemaphore(t, cli, SemaphoreOptions{})
		s.Close()
		if err := s.Healthy(); err == nil || err.Error() != `coord: semaphore "`+smKey+`": closed` {
			t.Fatalf("Healthy after Close: %v", err)
		}
		c := srv.NewClient(t)
		s2 := smSemaphore(t, c, SemaphoreOptions{})
		c.Close()
		if err := s2.Healthy(); !errors.Is(err, ErrClientClosed) {
			t.Fatalf("Healthy once the client is closed: %v", err)
		}
	})
}

func TestHealthShardSet(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("is unhealthy while it does not follow its hosts or candidates", func(t *testing.T) {
		for _, c := range []struct{ msg, want string }{
			{"coord: host watch broke, resyncing", "hosts not followed: watch broken for"},
			{"coord: shard set: candidate watch broke, listing again", "candidate watch broken for"},
		} {
			t.Run(c.want, func(t *testing.T) {
				srv, l, shards, hs := shFleet(t, 2, 2)
				g, log := newHtGate(t, c.msg)
				h := hs[0].start(t, l, ShardOptions{Shards: shards, TTL: time.Second, Logger: log})
				t.Cleanup(g.open)
				htHealthy(t, h.set)
				// Both watches run: they deliver a member and a host.
				hs[1].start(t, l, ShardOptions{Shards: shards})
				eventually(t, "the other member", func() bool { return len(h.set.Members()) == 2 })
				register(t, srv.Client(), "marker", LivenessOptions{})
				eventually(t, "the marker host", func() bool {
					h.set.mu.Lock()
					defer h.set.mu.Unlock()
					return h.set.view.hosts["marker"]
				})
				htBreakWatch(t, srv, srv.Client(), h.px, "/elsewhere/")
				waitClosed(t, g.reached, "the broken watch")
				err := htUnhealthy(t, h.set, c.want)
				t.Log(err)
				g.open()
				htHealthy(t, h.set)
			})
		}
	})
	t.Run("is unhealthy once etcd stops answering its sessions' renewals, and heals", func(t *testing.T) {
		// Cut off silently, its watches look live: the renewals of the
		// sessions that hold its member key and its shards' keys tell.
		_, l, shards, hs := shFleet(t, 4, 1)
		h := hs[0].start(t, l, ShardOptions{Shards: shards, TTL: 2 * time.Second * scale})
		eventually(t, "every shard owned", func() bool { return len(h.set.Owned()) == len(shards) })
		htHealthy(t, h.set)
		h.px.Blackhole()
		cut := time.Now()
		err := htUnhealthy(t, h.set, "member key: lease")
		t.Logf("%v after the cut: %v", time.Since(cut).Round(time.Millisecond), err)
		if !strings.Contains(err.Error(), "no renewal answered for") {
			t.Fatalf("Healthy: %v, want it to say no renewal answered", err)
		}
		h.px.Unblackhole()
		htHealthy(t, h.set)
	})
	t.Run("is closed after Close, and says why it ended by itself", func(t *testing.T) {
		_, l, shards, hs := shFleet(t, 2, 1)
		h := hs[0].start(t, l, ShardOptions{Shards: shards, Host: hs[0].live})
		htHealthy(t, h.set)
		if err := h.live.Stop(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, h.set.Done(), "Done of the shard set")
		err := htUnhealthy(t, h.set, "ended: host registration gone")
		if !errors.Is(err, ErrHostGone) {
			t.Fatalf("Healthy: %v, want it to wrap ErrHostGone", err)
		}
		_, l, shards, hs = shFleet(t, 2, 1)
		h = hs[0].start(t, l, ShardOptions{Shards: shards})
		h.set.Close()
		if err := h.set.Healthy(); err == nil || !strings.HasSuffix(err.Error(), ": closed") {
			t.Fatalf("Healthy after Close: %v", err)
		}
	})
}

// TestHealthFaultShapes checks, for each long-lived type and each way etcd
// stops answering (its process stopped, the link to it silent, its quorum
// lost), that Healthy turns non-nil within the bound its doc states: a
// third of the TTL and a second (the keeper's judgement, see
// keeper.unanswered; a watcher: UnhealthyAfter and a second), and nil
// again once etcd answers. Each object is busy, as in an outage that
// matters: the host registered, the watcher following, an Election and a
// pooled one leading, a permit held, a shard set owning its shards.
func TestHealthFaultShapes(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	ttl := 3 * time.Second * scale
	watchBound := time.Second * scale
	keeperBound := ttl/3 + min(ttl/6, time.Second)
	// slack for the check's poll, a renewal answered just as etcd stopped
	// answering, and a loaded machine.
	slack := 500 * time.Millisecond * scale
	shapes := []struct {
		name  string
		setup func(t *testing.T) (cli *clientv3.Client, fault, undo func())
	}{
		{"stopped", func(t *testing.T) (*clientv3.Client, func(), func()) {
			srv, _ := newEtcd(t)
			return srv.NewClient(t), srv.Stop, srv.Restart
		}},
		{"behind a silent link", func(t *testing.T) (*clientv3.Client, func(), func()) {
			srv, _ := newEtcd(t)
			px := srv.NewProxy(t)
			return px.NewClient(t), px.Blackhole, px.Unblackhole
		}},
		{"without quorum", func(t *testing.T) (*clientv3.Client, func(), func()) {
			c := coordtest.NewCluster(t, 3)
			leader := c.Leader(testCtx(t))
			var ours *coordtest.Member
			var others []*coordtest.Member
			for _, m := range c.Members() {
				if ours == nil && m != leader {
					ours = m
				} else {
					others = append(others, m)
				}
			}
			return ours.NewClient(t),
				func() {
					for _, m := range others {
						m.Stop()
					}
				},
				func() {
					for _, m := range others {
						m.Restart()
					}
				}
		}},
	}
	for _, sh := range shapes {
		t.Run("etcd "+sh.name, func(t *testing.T) {
			t.Parallel() // each shape on its own etcd
			cli, fault, undo := sh.setup(t)
			h := register(t, cli, "a", LivenessOptions{TTL: ttl})
			w, err := NewHostWatcher(testCtx(t), cli, WatcherOptions{UnhealthyAfter: watchBound})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { w.Close() })
			go func() {
				for range w.Events() {
				}
			}()
			e := etElection(t, cli, ElectionOptions{TTL: ttl})
			etCampaign(t, e, "e")
			p := ptPool(t, cli, PoolOptions{TTL: ttl})
			pe := ptElection(t, p, "/pool/e")
			etCampaign(t, pe, "pe")
			s := smSemaphore(t, cli, SemaphoreOptions{Limit: 1, TTL: ttl})
			smAcquire(t, s)
			shards := shNames(4)
			set, err := NewShardSet(testCtx(t), cli, ShardOptions{Host: h, Shards: shards, TTL: ttl, Run: idle})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { set.Close() })
			eventually(t, "every shard owned", func() bool { return len(set.Owned()) == len(shards) })
			checks := []struct {
				name  string
				c     Checker
				bound time.Duration
			}{
				{"HostLiveness", h, keeperBound}, {"HostWatcher", w, watchBound + time.Second},
				{"Election", e, keeperBound}, {"ElectionPool", p, keeperBound},
				{"Semaphore", s, keeperBound}, {"ShardSet", set, keeperBound},
			}
			for _, c := range checks {
				htHealthy(t, c.c)
			}
			// poll polls every check until each has said it is
			// unhealthy (good false) or healthy (good true) once, and
			// returns how long each took from since.
			poll := func(since time.Time, good bool) []time.Duration {
				took := make([]time.Duration, len(checks))
				left := len(checks)
				eventually(t, fmt.Sprintf("every check to say healthy: %v", good), func() bool {
					for i, c := range checks {
						if took[i] == 0 && (c.c.Healthy() == nil) == good {
							took[i], left = time.Since(since), left-1
						}
					}
					return left == 0
				})
				return took
			}
			fault()
			cut := time.Now()
			down := poll(cut, false)
			undo()
			back := time.Now()
			up := poll(back, true)
			for i, c := range checks {
				t.Logf("%-12s unhealthy %6v after etcd stopped answering (bound %v), healthy %6v after it answered again",
					c.name, down[i].Round(time.Millisecond), c.bound, up[i].Round(time.Millisecond))
				if down[i] > c.bound+slack {
					t.Errorf("%s: unhealthy %v after etcd stopped answering, bound %v", c.name, down[i], c.bound)
				}
			}
		})
	}
}
