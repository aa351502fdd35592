package coord

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
	"github.com/go-coord/coord/internal/testenv"
)

// scale stretches every deadline of the suite for slow machines (emulated
// CPUs): COORD_TEST_SCALE=10 waits ten times longer. Deadlines only bound
// waits on events; nothing sleeps for a fixed time.
var scale = testenv.Scale()

// Parallel tests: the tests of the package bound by waits (each over 2 s
// under emulation: the step-down shapes, the models, the shard handovers,
// the elections' and the watchers' longer ones, an etcd's restart) call
// t.Parallel, so they run after the others, GOMAXPROCS at a time (go
// test's -parallel; .ci/cross gives 8 under emulation), while their etcd
// leases run out. Each has its own etcd and clients, and none reads the
// log or signals of another; the rest of the suite stays sequential, so a
// test that counts goroutines (goleak.VerifyNone) sees only its own, and
// the tests that stop or isolate a cluster's members and time its
// elections (faults_cluster_test.go, faults_test.go, the lagging member of
// candidacy_test.go) are not slowed by the others.

// patience bounds any single wait of a test.
func patience() time.Duration { return 15 * time.Second * scale }

// testCtx returns a context that ends with the test or after patience.
func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience())
	t.Cleanup(cancel)
	return ctx
}

// newEtcd starts an embedded etcd for the test and returns it with a client.
func newEtcd(t *testing.T) (*coordtest.Server, *clientv3.Client) {
	t.Helper()
	srv := coordtest.NewServer(t)
	return srv, srv.Client()
}

// interceptedClient returns a client made from cfg whose unary calls go
// through icpt, closed at the end of the test.
func interceptedClient(t *testing.T, cfg clientv3.Config, icpt grpc.UnaryClientInterceptor) *clientv3.Client {
	t.Helper()
	return dialedClient(t, cfg, grpc.WithChainUnaryInterceptor(icpt))
}

// streamInterceptedClient returns a client made from cfg whose streams
// (watches, keep-alives) go through icpt, closed at the end of the test.
func streamInterceptedClient(t *testing.T, cfg clientv3.Config, icpt grpc.StreamClientInterceptor) *clientv3.Client {
	t.Helper()
	return dialedClient(t, cfg, grpc.WithChainStreamInterceptor(icpt))
}

// dialedClient returns a client made from cfg with opt added, closed at
// the end of the test.
func dialedClient(t *testing.T, cfg clientv3.Config, opt grpc.DialOption) *clientv3.Client {
	t.Helper()
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions), opt)
	cli, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// meta returns metadata for host id.
func meta(id string) HostMetadata {
	return HostMetadata{HostUUID: id, Hostname: "host-" + id, Version: "1.0", Labels: map[string]string{"zone": "a"}}
}

// prefixFor returns a prefix of its own for a test.
func prefixFor(t *testing.T) string { return "/test/" + t.Name() + "/" }

// next returns the next event of w, failing the test after patience.
func next(t *testing.T, w *HostWatcher) HostEvent {
	t.Helper()
	select {
	case ev, ok := <-w.Events():
		if !ok {
			t.Fatalf("events closed: %v", w.Err())
		}
		return ev
	case <-time.After(patience()):
		t.Fatal("no event before the deadline")
	}
	return HostEvent{}
}

// expect reads the next event of w and checks its kind and host.
func expect(t *testing.T, w *HostWatcher, kind HostEventKind, id string) HostEvent {
	t.Helper()
	ev := next(t, w)
	if ev.Kind != kind || ev.HostUUID != id {
		t.Fatalf("got %v %s, want %v %s", ev.Kind, ev.HostUUID, kind, id)
	}
	return ev
}

// quiet checks that w delivers nothing more up to a revision written after
// everything before: it puts a marker host and expects exactly its Up.
func quiet(t *testing.T, cli *clientv3.Client, w *HostWatcher, prefix string) {
	t.Helper()
	id := fmt.Sprintf("marker-%d", time.Now().UnixNano())
	ctx := testCtx(t)
	if _, err := cli.Put(ctx, prefix+id, fmt.Sprintf(`{"host_uuid":%q}`, id)); err != nil {
		t.Fatal(err)
	}
	expect(t, w, HostUp, id)
	if _, err := cli.Delete(ctx, prefix+id); err != nil {
		t.Fatal(err)
	}
	expect(t, w, HostDown, id)
}

// receive returns the next value sent on c, failing the test after
// patience.
func receive[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(patience()):
		t.Fatalf("%s: nothing before the deadline", what)
	}
	var zero T
	return zero
}

// isClosed reports whether c is closed now.
func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// closedWithin reports whether c is closed within patience.
func closedWithin(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	case <-time.After(patience()):
		return false
	}
}

// waitClosed fails the test unless c is closed within patience.
func waitClosed(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	if !closedWithin(c) {
		t.Fatalf("%s not closed before the deadline", what)
	}
}

// keyCount returns how many keys exist under prefix.
func keyCount(t *testing.T, cli *clientv3.Client, prefix string) int64 {
	t.Helper()
	resp, err := cli.Get(testCtx(t), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	return resp.Count
}

// truth reads the hosts etcd holds under prefix, as a watcher should see
// them.
func truth(t *testing.T, cli *clientv3.Client, prefix string) map[string]HostMetadata {
	t.Helper()
	resp, err := cli.Get(testCtx(t), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]HostMetadata{}
	for _, kv := range resp.Kvs {
		if m, err := decodeHost(prefix, kv.Key, kv.Value); err == nil {
			out[m.HostUUID] = m
		}
	}
	return out
}

// candidates returns the keys under prefix (an election's candidates),
// oldest first.
func candidates(t *testing.T, cli *clientv3.Client, prefix string) []*mvccpb.KeyValue {
	t.Helper()
	resp, err := cli.Get(testCtx(t), prefix, clientv3.WithPrefix(),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil {
		t.Fatalf("get candidates: %v", err)
	}
	return resp.Kvs
}

// eventually waits, up to patience, until cond holds; for state that no
// event announces (a field set just after etcd was written).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience())
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting for %s at the deadline", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// logTap is a slog.Handler that keeps every record, so that a test can wait
// for the library to say it reached a state.
type logTap struct {
	mu      sync.Mutex
	recs    []slog.Record
	changed chan struct{} // closed and replaced on each record
	attrs   []slog.Attr
	parent  *logTap
}

func newLogTap() (*logTap, *slog.Logger) {
	l := &logTap{changed: make(chan struct{})}
	return l, slog.New(l)
}

func (l *logTap) root() *logTap {
	if l.parent != nil {
		return l.parent
	}
	return l
}

func (l *logTap) Enabled(context.Context, slog.Level) bool { return true }

func (l *logTap) Handle(_ context.Context, r slog.Record) error {
	r = r.Clone()
	r.AddAttrs(l.attrs...)
	root := l.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	root.recs = append(root.recs, r)
	close(root.changed)
	root.changed = make(chan struct{})
	return nil
}

func (l *logTap) WithAttrs(as []slog.Attr) slog.Handler {
	return &logTap{parent: l.root(), attrs: append(slices.Clone(l.attrs), as...)}
}

func (l *logTap) WithGroup(string) slog.Handler { return l }

// count returns how many records carry msg.
func (l *logTap) count(msg string) int {
	root := l.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	n := 0
	for _, r := range root.recs {
		if r.Message == msg {
			n++
		}
	}
	return n
}

// wait waits until at least n records carry msg.
func (l *logTap) wait(t *testing.T, msg string, n int) {
	t.Helper()
	if !l.reached(msg, n) {
		t.Fatalf("no %d× log record %q before the deadline", n, msg)
	}
}

// reached waits, up to patience, until at least n records carry msg, and
// reports whether they did; it may run on any goroutine.
func (l *logTap) reached(msg string, n int) bool {
	deadline := time.After(patience())
	for {
		root := l.root()
		root.mu.Lock()
		changed := root.changed
		root.mu.Unlock()
		if l.count(msg) >= n {
			return true
		}
		select {
		case <-changed:
		case <-deadline:
			return false
		}
	}
}

// records returns the records that carry msg, in order.
func (l *logTap) records(msg string) []slog.Record {
	root := l.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	var rs []slog.Record
	for _, r := range root.recs {
		if r.Message == msg {
			rs = append(rs, r)
		}
	}
	return rs
}

// has reports whether a record carries msg and, unless key is "", the
// attribute key=key.
func (l *logTap) has(msg, key string) bool {
	root := l.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	for _, r := range root.recs {
		if r.Message != msg {
			continue
		}
		found := key == ""
		r.Attrs(func(a slog.Attr) bool {
			found = found || a.Key == "key" && a.Value.String() == key
			return !found
		})
		if found {
			return true
		}
	}
	return false
}

// timeOf returns when the first record carrying msg was logged after t0,
// the zero time if none was.
func (l *logTap) timeOf(msg string, t0 time.Time) time.Time {
	root := l.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	for _, r := range root.recs {
		if r.Message == msg && r.Time.After(t0) {
			return r.Time
		}
	}
	return time.Time{}
}

// lines returns every record, one line each: time, level, message and
// attributes.
func (l *logTap) lines() []string {
	root := l.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	var out []string
	for _, r := range root.recs {
		var b strings.Builder
		fmt.Fprintf(&b, "%s %s %s", r.Time.Format("15:04:05.000"), r.Level, r.Message)
		r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
		out = append(out, b.String())
	}
	return out
}

// text returns every record, one line each.
func (l *logTap) text() string { return strings.Join(l.lines(), "\n") }

// dumpOnFailure logs every record of the tap into the test log if the
// test fails.
func (l *logTap) dumpOnFailure(t *testing.T) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, line := range l.lines() {
			t.Log(line)
		}
	})
}

// signals collects what an OnSignal hook receives.
type signals struct {
	mu  sync.Mutex
	got []Signal
}

func (s *signals) hook(sig Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, sig)
}

// of returns the signals of kind received so far, in order.
func (s *signals) of(kind SignalKind) []Signal {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(s.got), func(sig Signal) bool { return sig.Kind != kind })
}

// waitFor waits until sig of kind has been received n times and returns the last.
func (s *signals) waitFor(t *testing.T, kind SignalKind, n int) Signal {
	t.Helper()
	var got []Signal
	eventually(t, fmt.Sprintf("%d× signal %v", n, kind), func() bool {
		got = s.of(kind)
		return len(got) >= n
	})
	return got[len(got)-1]
}

// mustOK returns a function that fails t on a non-nil error and ignores
// the value, for calls made only for their effect:
// must(cli.UserAdd(ctx, "root", "root")).
func mustOK(t *testing.T) func(any, error) {
	return func(_ any, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
}

// keyRange is the keys from key up to, not including, end.
type keyRange struct{ key, end string }

// prefixRange is every key under p.
func prefixRange(p string) keyRange { return keyRange{p, clientv3.GetPrefixRangeEnd(p)} }

// enableAuth turns auth on in srv: a root user, and one user per entry of
// grants (password = name) whose role may read and write the given
// ranges. It returns a function that opens a client logged in as a user.
func enableAuth(t *testing.T, srv *coordtest.Server, grants map[string][]keyRange) func(user string) *clientv3.Client {
	t.Helper()
	ctx := testCtx(t)
	cli := srv.Client()
	must := mustOK(t)
	must(cli.UserAdd(ctx, "root", "root"))
	must(cli.UserGrantRole(ctx, "root", "root"))
	for user, ranges := range grants {
		must(cli.RoleAdd(ctx, user))
		for _, r := range ranges {
			must(cli.RoleGrantPermission(ctx, user, r.key, r.end, clientv3.PermissionType(clientv3.PermReadWrite)))
		}
		must(cli.UserAdd(ctx, user, user))
		must(cli.UserGrantRole(ctx, user, user))
	}
	must(cli.AuthEnable(ctx))
	return func(user string) *clientv3.Client {
		cfg := srv.ClientConfig()
		cfg.Username, cfg.Password = user, user
		c, err := clientv3.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
}
