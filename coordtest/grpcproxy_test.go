package coordtest

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"
)

// grpcProxyFronts are the two kinds of GRPCProxy, by what they front: a
// Server (the proxy runs in the test process) and a Process (its binary
// runs the proxy: this test binary run as etcd, or COORD_TEST_ETCD's).
var grpcProxyFronts = []struct {
	name  string
	etcd  func(t *testing.T) Etcd
	child bool
}{
	{"in the test process", func(t *testing.T) Etcd { return NewServer(t) }, false},
	{"a child process", func(t *testing.T) Etcd { return NewProcess(t, etcdBinary(t), Config{}) }, true},
}

func TestGRPCProxy(t *testing.T) {
	for _, f := range grpcProxyFronts {
		t.Run(f.name, func(t *testing.T) {
			e := f.etcd(t)
			g := NewGRPCProxy(t, e)
			if child := g.bin != ""; child != f.child {
				t.Fatalf("the proxy runs as a child process: %v, want %v", child, f.child)
			}
			testGRPCProxy(t, e, g)
		})
	}
}

// testGRPCProxy: a client of g reads and writes etcd's data and holds
// leases; its watch sees what is written directly; across a Stop and a
// Restart on the same address, the same client and watch go on, and the
// watch misses nothing written while g was down.
func testGRPCProxy(t *testing.T, e Etcd, g *GRPCProxy) {
	ctx := testCtx(t)
	ep := g.Endpoint()
	if !strings.HasPrefix(ep, "http://127.0.0.1:") || ep == e.Endpoint() {
		t.Fatalf("Endpoint() = %q, want http://127.0.0.1:PORT of its own (etcd: %s)", ep, e.Endpoint())
	}
	pc := g.NewClient(t)
	mustPut(t, ctx, pc, "k", "1")
	if got, err := getValue(ctx, e.Client(), "k"); err != nil || got != "1" {
		t.Fatalf("Get from etcd = %q, %v; want what the proxy's client wrote, 1", got, err)
	}
	mustPut(t, ctx, e.Client(), "k", "2")
	if got, err := getValue(ctx, pc, "k"); err != nil || got != "2" {
		t.Fatalf("Get through the proxy = %q, %v; want 2", got, err)
	}
	mustGrantTTL(t, ctx, pc, 1, 1)
	wch := putAndWatch(t, ctx, pc, "w")
	mustPut(t, ctx, e.Client(), "w", "a")
	if got := watchValue(t, wch, bound(5*time.Second)); got != "a" {
		t.Fatalf("watch through the proxy got %q, want a", got)
	}

	g.Stop()
	g.Stop()
	sctx, cancel := context.WithTimeout(ctx, probeTimeout)
	_, err := pc.Get(sctx, "k")
	cancel()
	if err == nil {
		t.Fatal("Get through a stopped proxy succeeded")
	}
	mustPut(t, ctx, e.Client(), "w", "b") // while the proxy is down
	g.Restart()
	if got := g.Endpoint(); got != ep {
		t.Fatalf("Endpoint() after Restart = %q, want %q", got, ep)
	}
	if got := watchValue(t, wch, bound(10*time.Second)); got != "b" {
		t.Fatalf("watch through the restarted proxy got %q, want b, written while it was down", got)
	}
	waitValue(t, ctx, pc, "k", "2", "through the proxy after Restart")
}

// A Proxy in front of the gRPC proxy cuts its clients off, and only them.
func TestGRPCProxyNewProxy(t *testing.T) {
	ctx := testCtx(t)
	g := NewGRPCProxy(t, NewServer(t))
	px := g.NewProxy(t)
	cut, other := px.NewClient(t), g.NewClient(t)
	mustPut(t, ctx, cut, "k", "v")
	px.Blackhole()
	expectNoAnswer(t, ctx, cut, silence)
	mustPut(t, ctx, other, "k", "w")
	px.Unblackhole()
	waitValue(t, ctx, cut, "k", "w", "after Unblackhole")
}

// A proxy whose port was taken while it was stopped fails to start as a
// port taken (Restart then tries again), and does not take the stranger's
// answers for its own.
func TestGRPCProxyPortTaken(t *testing.T) {
	for _, f := range grpcProxyFronts {
		t.Run(f.name, func(t *testing.T) {
			g := NewGRPCProxy(t, f.etcd(t))
			g.Stop()
			ln, err := net.Listen("tcp", g.addr.Host)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			if err := g.startAndWait(); !errors.Is(err, errPortTaken) {
				t.Fatalf("start on a port taken: err = %v, want errPortTaken", err)
			}
		})
	}
}
