package coordtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-coord/coord/internal/etcdproxy"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/internal/testenv"
)

// GRPCProxy is etcd's gRPC proxy, `etcd grpc-proxy start`, in front of an
// Etcd, on a loopback port of its own: its clients read, write, watch and
// hold leases through it, and the watches of one key range, of all its
// clients, share one watch of etcd. Create it with NewGRPCProxy.
//
// It is the proxy of the etcd it fronts: in front of a Process, the
// process's binary runs `grpc-proxy start` as a child process (killed by
// the cleanup, and on Linux when the test binary dies, as a Process is; its
// log goes to a file in t.TempDir(), quoted when it fails to start). In
// front of anything else (a Server), the proxy runs in the test process:
// the services of go.etcd.io/etcd/server/v3/proxy/grpcproxy that `etcd
// grpc-proxy start` serves, on a grpc.Server, with no binary. With NewEtcd,
// the proxy is therefore of the binary COORD_TEST_ETCD names, else of the
// version this module embeds.
//
// Its port is fixed for its whole life, across Stop and Restart. A
// t.Cleanup closes every client and Proxy created through it, then stops
// it; once that has run no goroutine started by it remains. Methods that
// fail the test do so with the testing.TB given to NewGRPCProxy. All
// methods are safe for concurrent use.
type GRPCProxy struct {
	t      testing.TB
	target string // the client URL of the etcd it fronts
	bin    string // the etcd binary that runs it; "": the test process does
	// Fixed before the first start.
	addr    url.URL
	dir     string // its --data-dir
	logPath string

	// lifeMu serialises starting and stopping and guards the fields below.
	lifeMu sync.Mutex
	run    proxyRun // the running proxy; nil while stopped
	done   bool     // Close has run; never start again

	closeOnce sync.Once

	owner // what Close closes before stopping the proxy
}

// proxyRun is one run of a GRPCProxy, from its start to its stop: a child
// process, or a server in the test process.
type proxyRun interface {
	// exited is closed once the run has ended: stopped, or a child
	// process that died.
	exited() <-chan struct{}
	// stop ends the run, as a crash would, and returns once it is gone.
	stop()
}

// NewGRPCProxy starts etcd's gRPC proxy in front of e (see GRPCProxy) and
// waits (up to 30 s) until it serves: it answers for itself, and a read
// through it reaches e. It fails the test with t.Fatal if the proxy cannot
// be started. A t.Cleanup calls Close.
func NewGRPCProxy(t testing.TB, e Etcd) *GRPCProxy {
	t.Helper()
	g := &GRPCProxy{t: t, target: e.Endpoint(), owner: owner{gone: "the gRPC proxy was closed"}}
	if p, ok := e.(*Process); ok {
		g.bin = p.bin
	}
	base := t.TempDir()
	g.dir = filepath.Join(base, "data")
	t.Cleanup(g.Close)
	var err error
	for attempt := 0; attempt < portAttempts; attempt++ {
		var ports []int
		if ports, err = testenv.LoopbackPorts(1); err != nil {
			break
		}
		g.addr = loopbackURL("http", ports[0])
		// A log per attempt: a failure quotes its own.
		g.logPath = filepath.Join(base, fmt.Sprintf("grpc-proxy-%d.log", attempt))
		if err = g.startAndWait(); !errors.Is(err, errPortTaken) {
			break
		}
	}
	if err != nil {
		t.Fatalf("coordtest: %v", err)
	}
	return g
}

// Endpoint returns the proxy's client URL, "http://127.0.0.1:PORT". It does
// not change across Stop and Restart.
func (g *GRPCProxy) Endpoint() string { return g.addr.String() }

// ClientConfig is Server.ClientConfig with the proxy as the only endpoint.
func (g *GRPCProxy) ClientConfig() clientv3.Config { return clientConfig(g.Endpoint()) }

// NewClient returns a new client whose only endpoint is the proxy. It is
// closed by a t.Cleanup, or by the proxy's Close if that runs first;
// closing it earlier as well is harmless. It fails the test (through t) on
// error.
func (g *GRPCProxy) NewClient(t testing.TB) *clientv3.Client {
	t.Helper()
	return newTestClient(t, g.ClientConfig(), g)
}

// NewProxy starts a Proxy in front of the gRPC proxy: a client of the
// Proxy can be cut off from the gRPC proxy while the gRPC proxy keeps its
// link to etcd. It is closed by a t.Cleanup, or by the gRPC proxy's Close
// if that runs first. It fails the test (through t) if the Proxy cannot be
// started.
func (g *GRPCProxy) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	return newProxy(t, g.addr, g)
}

// Stop stops the proxy as a crash would (a child process is killed): its
// connections close, in-flight requests fail, and its clients reconnect
// after Restart; etcd keeps running. The leases the proxy was renewing for
// its clients are left to expire. Stop is idempotent.
func (g *GRPCProxy) Stop() {
	g.lifeMu.Lock()
	defer g.lifeMu.Unlock()
	g.stopLocked()
}

// Restart stops the proxy if it is running and starts it again on the same
// port, and returns once it serves (see NewGRPCProxy). If the port is still
// in use it retries for up to 5 s. It fails the test on error, including
// when called after Close.
func (g *GRPCProxy) Restart() {
	g.t.Helper()
	deadline := time.Now().Add(rebindTimeout)
	for {
		err := g.startAndWait()
		if err == nil {
			return
		}
		if !errors.Is(err, errPortTaken) || time.Now().After(deadline) {
			g.t.Fatalf("coordtest: %v", err)
		}
		time.Sleep(rebindPoll)
	}
}

// Close closes every client and Proxy created through the proxy, then
// stops it, and returns once none of their goroutines remains. It cannot
// be restarted afterwards. Close is idempotent.
func (g *GRPCProxy) Close() {
	g.closeOnce.Do(func() {
		proxies := g.closeClients()
		g.lifeMu.Lock()
		g.done = true
		g.stopLocked()
		g.lifeMu.Unlock()
		for _, px := range proxies {
			px.close()
		}
	})
}

// startAndWait starts the proxy (stopping a running one first) and waits,
// without holding lifeMu, until it serves, or fails; on failure it stops
// it.
func (g *GRPCProxy) startAndWait() error {
	run, err := g.start()
	if err != nil {
		return err
	}
	if err := g.waitReady(run, time.Now().Add(readyTimeout)); err != nil {
		g.lifeMu.Lock()
		defer g.lifeMu.Unlock()
		if g.run == run { // not stopped or replaced meanwhile
			g.stopLocked()
		}
		return err
	}
	return nil
}

// start stops the running proxy, if any, and starts a new run, without
// waiting for it to serve.
func (g *GRPCProxy) start() (proxyRun, error) {
	g.lifeMu.Lock()
	defer g.lifeMu.Unlock()
	if g.done {
		return nil, errors.New("starting the gRPC proxy: it was closed")
	}
	g.stopLocked()
	var err error
	if g.bin != "" {
		g.run, err = g.startChild()
	} else {
		g.run, err = g.startInProcess()
	}
	if err != nil {
		g.run = nil // not a nil *proxyChild or *proxyServer
		return nil, err
	}
	return g.run, nil
}

// stopLocked stops the running proxy, if any. lifeMu must be held.
func (g *GRPCProxy) stopLocked() {
	if g.run != nil {
		g.run.stop()
		g.run = nil
	}
}

// waitReady probes the proxy until it answers for itself (a member list
// holding its own address, which `grpc-proxy` answers without etcd: not
// another server that took the port) and a read through it reaches etcd,
// the run ends, or the deadline passes.
func (g *GRPCProxy) waitReady(run proxyRun, deadline time.Time) error {
	cli, err := clientv3.New(g.ClientConfig())
	if err != nil {
		return fmt.Errorf("probing the gRPC proxy on %s: %w", g.Endpoint(), err)
	}
	defer cli.Close()
	for {
		err = g.probe(cli)
		if err == nil {
			return nil
		}
		select {
		case <-run.exited():
			return g.failure("ended before serving")
		case <-time.After(readyPoll):
		}
		if time.Now().After(deadline) {
			return g.failure(fmt.Sprintf("not serving after %v (%v)", readyTimeout, err))
		}
	}
}

// probe asks the proxy, once, for its member list and then reads through
// it.
func (g *GRPCProxy) probe(cli *clientv3.Client) error {
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	resp, err := cli.MemberList(ctx)
	if err != nil {
		return err
	}
	ours := slices.ContainsFunc(resp.Members, func(m *pb.Member) bool {
		return slices.Contains(m.ClientURLs, g.addr.Host)
	})
	if !ours {
		return fmt.Errorf("another server answers on %s", g.Endpoint())
	}
	_, err = cli.Get(ctx, "health")
	return err
}

// failure is the error of a start that failed: what happened and, for a
// child process, the end of its log (wrapping errPortTaken when the log
// says its port was in use).
func (g *GRPCProxy) failure(what string) error {
	if g.bin == "" {
		return fmt.Errorf("the gRPC proxy on %s %s", g.Endpoint(), what)
	}
	return logFailure(g.logPath, fmt.Sprintf("etcd grpc-proxy (%s) on %s %s", g.bin, g.Endpoint(), what))
}

// proxyChild is a run of `etcd grpc-proxy start` as a child process.
type proxyChild struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited
}

func (c *proxyChild) exited() <-chan struct{} { return c.done }

func (c *proxyChild) stop() {
	_ = c.cmd.Process.Kill() // fails only if it has exited already
	<-c.done
}

// startChild runs the binary's gRPC proxy, its log appended to the file
// at logPath. The flags are those that every etcd since 3.4 accepts.
func (g *GRPCProxy) startChild() (*proxyChild, error) {
	log, err := os.OpenFile(g.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("starting etcd grpc-proxy: %w", err)
	}
	defer log.Close() // the child has its own copy
	cmd := exec.Command(g.bin, "grpc-proxy", "start",
		"--endpoints="+g.target,
		"--listen-addr="+g.addr.Host,
		// What its member list answers: its own address, by which
		// waitReady tells it from another server.
		"--advertise-client-url="+g.addr.Host,
		"--data-dir="+g.dir,
	)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s grpc-proxy: %w", g.bin, err)
	}
	c := &proxyChild{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait() // a kill is how it ends; its status says nothing more
		close(c.done)
	}()
	return c, nil
}

// proxyServer is a run of the gRPC proxy in the test process.
type proxyServer struct {
	*etcdproxy.Server
	t testing.TB // told if stop cannot wait for the proxies' goroutines
}

// proxyStopTimeout bounds the wait for an in-process proxy's goroutines
// to end once its server and client are closed; see proxyServer.stop.
const proxyStopTimeout = 10 * time.Second

func (s *proxyServer) exited() <-chan struct{} { return s.Served() }

// stop closes the server's listener and connections, its in-flight RPCs
// cancelled (as a crash leaves them), then the proxy's client of etcd, and
// waits for the proxies' goroutines. The wait is bounded as a safeguard.
func (s *proxyServer) stop() {
	if !s.Stop(proxyStopTimeout) {
		s.t.Errorf("coordtest: gRPC proxy: goroutines still running %v after being stopped", proxyStopTimeout)
	}
}

// startInProcess serves, on a grpc.Server in the test process, the
// services `etcd grpc-proxy start` serves, built as it builds them.
func (g *GRPCProxy) startInProcess() (*proxyServer, error) {
	ln, err := net.Listen("tcp", g.addr.Host)
	if err != nil {
		if isAddrInUse(err) {
			err = fmt.Errorf("%w: %w", errPortTaken, err)
		}
		return nil, fmt.Errorf("starting the gRPC proxy on %s: %w", g.Endpoint(), err)
	}
	srv, err := etcdproxy.Serve(ln, clientConfig(g.target), g.addr.Host)
	if err != nil {
		return nil, fmt.Errorf("starting the gRPC proxy on %s: %w", g.Endpoint(), err)
	}
	return &proxyServer{Server: srv, t: g.t}, nil
}
