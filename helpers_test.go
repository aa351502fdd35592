package coord

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/coordtest"
)

// scale stretches every deadline of the suite for slow machines (emulated
// CPUs): COORD_TEST_SCALE=10 waits ten times longer. Deadlines only bound
// waits on events; nothing sleeps for a fixed time.
var scale = func() time.Duration {
	n, err := strconv.Atoi(os.Getenv("COORD_TEST_SCALE"))
	if err != nil || n < 1 {
		return 1
	}
	return time.Duration(n)
}()

// Parallel tests: the longest tests of the package (each over 20 s under
// emulation: the step-down shapes, the models, the shard handovers) call
// t.Parallel, so they run after the others, two at a time (go test's
// -parallel is GOMAXPROCS), while their etcd leases run out. Each has its
// own etcd and clients, and none reads the log or signals of another; the
// rest of the suite stays sequential, so a test that counts goroutines
// (goleak.VerifyNone) sees only its own.

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

// closed reports whether c is closed within patience.
func closedWithin(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	case <-time.After(patience()):
		return false
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

// eventually waits, up to patience, until cond holds; for state that no
// event announces (a field set just after etcd was written).
func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience())
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met before the deadline")
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
	deadline := time.After(patience())
	for {
		root := l.root()
		root.mu.Lock()
		changed := root.changed
		root.mu.Unlock()
		if l.count(msg) >= n {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("no %d× log record %q before the deadline", n, msg)
		}
	}
}

// enableAuth turns auth on in srv: a root user, and one user per entry of
// grants (password = name) whose role may read and write the given
// prefixes. It returns a function that opens a client logged in as a user.
func enableAuth(t *testing.T, srv *coordtest.Server, grants map[string][]string) func(user string) *clientv3.Client {
	t.Helper()
	ctx := testCtx(t)
	cli := srv.Client()
	must := func(_ any, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(cli.UserAdd(ctx, "root", "root"))
	must(cli.UserGrantRole(ctx, "root", "root"))
	for user, prefixes := range grants {
		must(cli.RoleAdd(ctx, user))
		for _, p := range prefixes {
			must(cli.RoleGrantPermission(ctx, user, p, clientv3.GetPrefixRangeEnd(p), clientv3.PermissionType(clientv3.PermReadWrite)))
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

// dump logs every record of the tap into the test log.
func (l *logTap) dump(t *testing.T) {
	root := l.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	for _, r := range root.recs {
		var b strings.Builder
		r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
		t.Logf("%s %s%s", r.Level, r.Message, b.String())
	}
}
