package coord

import (
	"fmt"
	"testing"
	"time"

	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestCompatGRPCProxy: the deployment of docs/fleet.md on every etcd
// version, with that version's gRPC proxy (coordtest.NewGRPCProxy): the
// watches of HostWatchers through `etcd grpc-proxy start`, the leases
// straight to etcd; and why the leases must not go through it.
func TestCompatGRPCProxy(t *testing.T) {
	t.Parallel() // bound by waits on leases: see "Parallel tests" in helpers_test.go
	for _, p := range []struct {
		name string
		test func(*testing.T)
	}{
		{"watchers", testCompatProxyWatchers}, // through the proxy, leases direct
		{"shardset", testCompatProxyShardSet}, // its host watch through the proxy
		{"observe", testCompatProxyObserve},   // an election's observers through the proxy
		{"lease", testCompatProxyLease},       // through the proxy: outlives its client
	} {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			p.test(t)
		})
	}
}

// testCompatProxyWatchers: HostWatchers through the proxy see a crashed
// host Down within its TTL, as they would directly, and their replicas
// match etcd; across a restart of the proxy they miss nothing of what
// changed while it was down, and deliver nothing twice.
func testCompatProxyWatchers(t *testing.T) {
	e := compatEtcd(t)
	g := coordtest.NewGRPCProxy(t, e)
	cli, ttl := e.Client(), compatTTL()
	var rs []*fcRecorder
	for range 3 {
		rs = append(rs, fcWatch(t, g.NewClient(t), WatcherOptions{}))
	}
	hosts := map[string]*compatHost{}
	for _, id := range []string{"a", "b", "c"} {
		hosts[id] = compatRegister(t, e, id, ttl)
	}
	for _, r := range rs {
		for id := range hosts {
			compatNext(t, r, 0, HostUp, id)
		}
	}

	// A crash: Down within the TTL, at every watcher.
	marks := compatMarks(rs)
	crashed := hosts["c"].crash()
	var crashTook time.Duration
	for i, r := range rs {
		crashTook = max(crashTook, compatNext(t, r, marks[i], HostDown, "c").Sub(crashed))
	}
	compatWithin(t, "crash → Down through the proxy", crashTook, ttl)
	for _, r := range rs {
		r.converge(t, cli, HostsPrefix)
	}

	// The proxy restarts; meanwhile a host is updated, one stops and one
	// registers. Each watcher then delivers exactly those changes.
	marks = compatMarks(rs)
	g.Stop()
	upd := meta("a")
	upd.Version = "2.0"
	if err := hosts["a"].live.Update(testCtx(t), upd); err != nil {
		t.Fatalf("Update: %v", err)
	}
	if err := hosts["b"].live.Stop(testCtx(t)); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	compatRegister(t, e, "d", ttl)
	restarted := time.Now()
	g.Restart()
	var restartTook time.Duration
	want := "updated a, down b, up d"
	for i, r := range rs {
		at := r.until(t, "the changes made while the proxy was down", func(evs []HostEvent) bool {
			return len(evs)-marks[i] >= 3
		})
		restartTook = max(restartTook, at.Sub(restarted))
		if got := fcKinds(r.since(marks[i], 0)); got != want {
			t.Errorf("watcher %d after the proxy's restart: %s, want %s", i, got, want)
		}
		r.converge(t, cli, HostsPrefix)
	}
	fcQuiet(t, cli, HostsPrefix, rs...)
	compatFigures(t, "grpc-proxy/watchers", "watchers", len(rs), "ttl", ttl, "crash→down", crashTook,
		"restart→caught-up", restartTook)
}

// testCompatProxyShardSet: testCompatShardSet with each member's host
// watch through the proxy (ShardOptions.WatchClient), its leases, reads
// and other watches straight to etcd: the shards spread as ranked, a
// crashed member's move to the next in rank within the same bound, and the
// fenced writes never overlap.
func testCompatProxyShardSet(t *testing.T) {
	e := compatEtcd(t)
	g := coordtest.NewGRPCProxy(t, e)
	compatShardSet(t, e, "grpc-proxy/shardset", func(tb testing.TB) *clientv3.Client { return g.NewClient(tb) })
}

// testCompatProxyObserve: observers of an election, each Observe through
// the proxy (WatchClient), see the leader, and its successor once it
// crashes: within the TTL, as directly.
func testCompatProxyObserve(t *testing.T) {
	e := compatEtcd(t)
	g := coordtest.NewGRPCProxy(t, e)
	ttl := compatTTL()
	opts := ElectionOptions{Key: "/compat/observed", TTL: ttl}
	px := e.NewProxy(t)
	leaderCli := px.NewClient(t)
	etCampaign(t, etElection(t, leaderCli, opts), "a")
	var observed []<-chan string
	for range 3 {
		o := opts
		o.WatchClient = g.NewClient(t)
		obs := etElection(t, e.Client(), o).Observe(testCtx(t))
		etExpect(t, obs, "a")
		observed = append(observed, obs)
	}
	res := etCampaignAsync(testCtx(t), etElection(t, e.Client(), opts), "b")
	etWaitCount(t, e.Client(), opts.Key+"/", 2, clientv3.WithPrefix())
	px.Blackhole()
	crashed := time.Now()
	leaderCli.Close()
	var took time.Duration
	for _, obs := range observed {
		etExpect(t, obs, "b")
		took = max(took, time.Since(crashed))
	}
	if r := etWait(t, res); r.err != nil {
		t.Fatal(r.err)
	}
	compatWithin(t, "leader crash → successor observed through the proxy", took, ttl)
	compatFigures(t, "grpc-proxy/observe", "crash-observed", took)
}

// compatMarks returns how many events each recorder holds now.
func compatMarks(rs []*fcRecorder) []int {
	marks := make([]int, len(rs))
	for i, r := range rs {
		marks[i] = r.len()
	}
	return marks
}

// testCompatProxyLease: a host whose lease is renewed through the proxy
// and one whose lease is renewed directly, both renewed for a TTL, go
// silent at once. The direct one is Down within its TTL. The proxy renews
// the other's lease with a client of its own, on that client's schedule
// (a third of the TTL, on a 500 ms tick), and answers a renewal only when
// its own is answered: late, so that tries time out (late) and the lease
// can go unvouched for (unvouched), as the figures count. It goes on
// renewing after its client has gone silent, until a timer of its own
// gives up, a TTL after the last renewal it answered. How much longer the
// key lives than the direct one depends on those schedules, so it is only
// logged; the test asserts the bound they keep: three TTLs.
func testCompatProxyLease(t *testing.T) {
	e := compatEtcd(t)
	g := coordtest.NewGRPCProxy(t, e)
	cli, ttl := e.Client(), compatTTL()
	r := fcWatch(t, cli, WatcherOptions{})
	direct, directLog := compatRegisterLogged(t, e, "direct", ttl)
	proxied, proxiedLog := compatRegisterLogged(t, g, "proxied", ttl)
	compatNext(t, r, 0, HostUp, "direct")
	compatNext(t, r, 0, HostUp, "proxied")
	// Renewed for a TTL: the proxy renews the lease on its own by then.
	from := time.Now().Add(ttl)
	for _, h := range []*compatHost{direct, proxied} {
		compatRenewedSince(t, h, from)
	}
	late := func(tap *logTap) string {
		return fmt.Sprintf("%d/%d", tap.count("coord: lease renewal failed"), tap.count("coord: lease renewals unanswered"))
	}
	directLate, proxiedLate := late(directLog), late(proxiedLog)

	// Silent, as behind a partition or in a hung process: a client that
	// closes its connection (a crash) ends its renewal stream, and with it
	// the proxy's renewals.
	mark := r.len()
	silent := time.Now()
	for _, h := range []*compatHost{direct, proxied} {
		h.px.Blackhole()
		t.Cleanup(h.px.Unblackhole) // before the registration's Stop: its revoke gets through
	}
	directTook := compatNext(t, r, mark, HostDown, "direct").Sub(silent)
	proxiedTook := compatNext(t, r, mark, HostDown, "proxied").Sub(silent)
	compatWithin(t, "silence → Down, lease direct", directTook, ttl)
	compatWithin(t, "silence → Down, lease through the proxy", proxiedTook, 3*ttl)
	compatFigures(t, "grpc-proxy/lease", "ttl", ttl,
		"direct:silent→down", directTook, "proxied:silent→down", proxiedTook, "outlived-direct-by", proxiedTook-directTook,
		"direct:late/unvouched", directLate, "proxied:late/unvouched", proxiedLate)
}

// compatRegisterLogged is compatRegister through a proxy in front of via
// (etcd, or its gRPC proxy), the registration logging to a tap of its own.
func compatRegisterLogged(t *testing.T, via interface {
	NewProxy(testing.TB) *coordtest.Proxy
}, id string, ttl time.Duration) (*compatHost, *logTap) {
	t.Helper()
	tap, log := newLogTap()
	h := &compatHost{id: id, px: via.NewProxy(t)}
	h.cli = h.px.NewClient(t)
	h.live = register(t, h.cli, id, LivenessOptions{TTL: ttl, Logger: log})
	return h, tap
}

// compatRenewedSince waits until etcd has answered a renewal of h's lease
// sent at from or later.
func compatRenewedSince(t *testing.T, h *compatHost, from time.Time) {
	t.Helper()
	h.live.mu.Lock()
	k := h.live.keep
	h.live.mu.Unlock()
	eventually(t, "renewals of "+h.id, func() bool { return !k.lastAnswer().Before(from) })
}
