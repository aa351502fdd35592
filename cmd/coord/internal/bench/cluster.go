package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-coord/coord/coordtest"
	"github.com/go-coord/coord/internal/etcdproxy"
	"github.com/go-coord/coord/internal/testenv"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// benchClusterEnv, when set, makes this binary (the coord command, or its
// test binary) run an embedded etcd cluster for the bench and nothing else.
// Its value is "<members>:<data directory>". The bench starts such a child
// process for scenario 9, so that the cluster's CPU time and memory can be
// told apart from the agents'.
const benchClusterEnv = "COORD_BENCH_CLUSTER"

// benchProxyEnv, when set, makes this binary run etcd's gRPC proxy in
// front of the etcd at its value, and nothing else: scenario 12's proxy,
// in a process of its own so that its CPU time is its own.
const benchProxyEnv = "COORD_BENCH_PROXY"

func init() {
	if spec, ok := os.LookupEnv(benchClusterEnv); ok {
		os.Exit(benchClusterChild(spec, os.Stdin, os.Stdout))
	}
	if target, ok := os.LookupEnv(benchProxyEnv); ok {
		os.Exit(benchProxyChild(target, os.Stdin, os.Stdout))
	}
}

// benchClusterChild runs the cluster described by spec. It prints
// "ready <endpoints>" once every member serves (or "error <why>"), then
// answers what benchChildStats answers, and "replace" (see
// benchMembers.replace). It returns when in ends: the parent is done
// with it, or gone. Nothing is shut down gracefully: the process exits,
// and the parent removes the data.
func benchClusterChild(spec string, in io.Reader, out io.Writer) int {
	n, dir, ok := strings.Cut(spec, ":")
	members, err := strconv.Atoi(n)
	if !ok || err != nil || members < 1 || dir == "" {
		fmt.Fprintf(out, "error bad %s %q\n", benchClusterEnv, spec)
		return 1
	}
	m, err := benchStartMembers(dir, members)
	if err != nil {
		fmt.Fprintf(out, "error %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		return 1
	}
	fmt.Fprintf(out, "ready %s\n", strings.Join(m.endpoints, ","))
	benchChildStats(in, out, m.replace)
	return 0
}

// benchProxyChild runs etcd's gRPC proxy in front of the etcd at target,
// on a loopback port. It prints "ready <endpoint>" once it serves (or
// "error <why>"), then answers what benchChildStats answers, until in ends.
func benchProxyChild(target string, in io.Reader, out io.Writer) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err == nil {
		cfg := clientv3.Config{Endpoints: []string{target}, DialTimeout: 10 * time.Second, Logger: zap.NewNop()}
		_, err = etcdproxy.Serve(ln, cfg, ln.Addr().String())
	}
	if err != nil {
		fmt.Fprintf(out, "error gRPC proxy: %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		return 1
	}
	fmt.Fprintf(out, "ready http://%s\n", ln.Addr())
	benchChildStats(in, out, nil)
	return 0
}

// benchChildStats answers each "stat" line read from in with "stat <cpu
// ns> <rss bytes> <peak rss bytes> 0 <sent bytes> <watches> <when, Unix
// ns>" (0 where the platform cannot tell; sent and watches: etcd's, see
// benchEtcdMetrics, 0 in a proxy; when: of the CPU time's reading), and each "gc" line the same way after a garbage
// collection that gives freed memory back to the system, with the live
// heap in place of the 0. A "replace" line calls replace (nil: none) and
// is answered as "stat" once it has returned, or with "error <why>".
func benchChildStats(in io.Reader, out io.Writer, replace func() error) {
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		var heap uint64
		switch sc.Text() {
		case "stat":
		case "gc":
			// What the members keep, without the garbage of what they did.
			debug.FreeOSMemory()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			heap = ms.HeapAlloc
		case "replace":
			err := errors.New("nothing to replace")
			if replace != nil {
				err = replace()
			}
			if err != nil {
				fmt.Fprintf(out, "error %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
				continue
			}
		default:
			continue
		}
		at := time.Now().UnixNano()
		cpu, _ := benchProcessCPU()
		rss, peak := benchProcessRSS()
		sent, watchers := benchEtcdMetrics()
		fmt.Fprintf(out, "stat %d %d %d %d %d %d %d\n", cpu, rss, peak, heap, sent, watchers, at)
	}
}

// benchEtcdMetrics returns, read from this process's Prometheus registry,
// etcd's count of the bytes its gRPC server sent to clients
// (etcd_network_client_grpc_sent_bytes_total) and the watches it serves
// (etcd_debugging_mvcc_watcher_total); 0 where there is none.
func benchEtcdMetrics() (sent, watchers int64) {
	families, _ := prometheus.DefaultGatherer.Gather()
	for _, f := range families {
		if len(f.GetMetric()) == 0 {
			continue
		}
		switch m := f.GetMetric()[0]; f.GetName() {
		case "etcd_network_client_grpc_sent_bytes_total":
			sent = int64(m.GetCounter().GetValue())
		case "etcd_debugging_mvcc_watcher_total":
			watchers = int64(m.GetGauge().GetValue())
		}
	}
	return sent, watchers
}

// benchMembers is the etcd cluster a child process runs.
type benchMembers struct {
	dir       string
	ports     []int // each member's client port, then its peer port
	endpoints []string
	etcds     []*embed.Etcd
	replaced  int // how many times it was replaced
}

// benchStartMembers starts an etcd cluster of n members in this process,
// tuned as coordtest tunes its servers, with their data under dir, and
// returns it once all are ready. It tries other ports if one was taken
// meanwhile.
func benchStartMembers(dir string, n int) (*benchMembers, error) {
	var err error
	for attempt := range 5 {
		m := &benchMembers{dir: filepath.Join(dir, fmt.Sprint(attempt))}
		if m.ports, err = testenv.LoopbackPorts(2 * n); err != nil {
			return nil, err
		}
		if err = m.start("coord-bench"); err == nil {
			return m, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) {
			break
		}
	}
	return nil, err
}

// replace stops the members and starts on their ports another cluster,
// empty (a new cluster ID, its revisions starting over), as an etcd
// rebuilt or replaced under its clients.
func (m *benchMembers) replace() error {
	for _, e := range m.etcds {
		e.Close()
	}
	m.replaced++
	m.dir = filepath.Join(m.dir, fmt.Sprintf("replaced-%d", m.replaced))
	return m.start(fmt.Sprintf("coord-bench-replaced-%d", m.replaced))
}

// start starts the members, with their data under m.dir and token as
// their cluster token, and waits until every one is ready.
func (m *benchMembers) start(token string) error {
	n := len(m.ports) / 2
	loopback := func(port int) url.URL {
		return url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
	}
	var peers []string
	m.endpoints, m.etcds = nil, nil
	for i := range n {
		client, peer := loopback(m.ports[2*i]), loopback(m.ports[2*i+1])
		peers = append(peers, fmt.Sprintf("m%d=%s", i, peer.String()))
		m.endpoints = append(m.endpoints, client.String())
	}
	for i := range n {
		cfg := embed.NewConfig()
		cfg.Name = fmt.Sprintf("m%d", i)
		cfg.Dir = filepath.Join(m.dir, cfg.Name)
		cfg.TickMs, cfg.ElectionMs = coordtest.DefaultTickMs, coordtest.DefaultElectionMs
		client, peer := loopback(m.ports[2*i]), loopback(m.ports[2*i+1])
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
		cfg.InitialCluster = strings.Join(peers, ",")
		cfg.InitialClusterToken = token
		cfg.ListenMetricsUrls = nil
		cfg.UnsafeNoFsync = true
		cfg.AutoCompactionRetention = "0"
		cfg.EnableGRPCGateway = false
		cfg.Logger, cfg.LogLevel = "zap", "error"
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
		// One by one: a member asks those already up whether the cluster
		// is bootstrapped; it does not wait for the others to be ready.
		e, err := embed.StartEtcd(cfg)
		if err != nil {
			return fmt.Errorf("starting member %s: %w", cfg.Name, err)
		}
		m.etcds = append(m.etcds, e)
	}
	deadline := time.NewTimer(60 * time.Second)
	defer deadline.Stop()
	for _, e := range m.etcds {
		select {
		case <-e.Server.ReadyNotify():
		case err := <-e.Err():
			return fmt.Errorf("member failed before it was ready: %w", err)
		case <-deadline.C:
			return errors.New("members not ready after 60 s")
		}
	}
	return nil
}

// benchCluster is an embedded etcd cluster (or a gRPC proxy) in a child
// process of the bench: its CPU time and memory are its own.
type benchCluster struct {
	endpoints []string
	dir       string
	cmd       *exec.Cmd
	in        io.WriteCloser
	out       *bufio.Reader
	stderr    *benchTail
	exited    chan struct{} // closed once the child has exited
}

// benchClusterStat is what the child process has used.
type benchClusterStat struct {
	cpu       time.Duration
	rss, peak int64     // bytes; 0 where the platform cannot tell
	heap      int64     // bytes of live heap, after a gc
	sent      int64     // bytes etcd's gRPC server sent to its clients; 0 in a proxy
	watches   int64     // watches etcd serves; 0 in a proxy
	at        time.Time // when the child read its CPU time
}

// start starts the child, command name with args and env.
func (c *benchCluster) start(env []string, name string, args ...string) (err error) {
	c.cmd = exec.Command(name, args...)
	c.cmd.Env = env
	c.cmd.Stderr = c.stderr
	if c.in, err = c.cmd.StdinPipe(); err != nil {
		return err
	}
	out, err := c.cmd.StdoutPipe()
	if err != nil {
		return err
	}
	c.out = bufio.NewReader(out)
	return c.cmd.Start()
}

// startBenchCluster starts a cluster of n members in a child process (this
// binary again, with benchClusterEnv set) and waits until it serves.
func startBenchCluster(ctx context.Context, n int) (*benchCluster, error) {
	dir, err := benchTempDir()
	if err != nil {
		return nil, fmt.Errorf("bench: cluster: %w", err)
	}
	c, err := startBenchChild(ctx, fmt.Sprintf("%s=%d:%s", benchClusterEnv, n, dir), dir)
	if err != nil {
		return nil, fmt.Errorf("bench: cluster of %d: %w", n, err)
	}
	return c, nil
}

// startBenchProxy starts etcd's gRPC proxy in front of target in a child
// process (benchProxyEnv) and waits until it serves; its endpoints are
// the proxy's.
func startBenchProxy(ctx context.Context, target string) (*benchCluster, error) {
	c, err := startBenchChild(ctx, benchProxyEnv+"="+target, "")
	if err != nil {
		return nil, fmt.Errorf("bench: gRPC proxy: %w", err)
	}
	return c, nil
}

// startBenchChild starts this binary again with setting added to its
// environment, and waits for its "ready" line; dir, if set, is the
// child's to remove once it has exited.
func startBenchChild(ctx context.Context, setting, dir string) (_ *benchCluster, err error) {
	exe, err := os.Executable()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	c := &benchCluster{dir: dir, stderr: &benchTail{}, exited: make(chan struct{})}
	env := append(os.Environ(), setting)
	err = c.start(env, exe)
	if errors.Is(err, syscall.ENOEXEC) {
		// Under user-mode emulation (how CI tests the other
		// architectures) the kernel may not run this binary by itself:
		// run it under the same emulator.
		var emu string
		if emu, err = exec.LookPath(testenv.Emulator()); err == nil {
			err = c.start(env, emu, exe)
		}
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	go func() { _ = c.cmd.Wait(); close(c.exited) }()
	defer func() {
		if err != nil {
			err = errors.Join(err, c.close())
		}
	}()
	ready := make(chan error, 1)
	go func() {
		line, err := c.out.ReadString('\n')
		switch {
		case strings.HasPrefix(line, "ready "):
			c.endpoints = strings.Split(strings.TrimSpace(strings.TrimPrefix(line, "ready ")), ",")
			ready <- nil
		case err != nil:
			ready <- fmt.Errorf("child exited: %w", err)
		default:
			ready <- errors.New(strings.TrimSpace(line))
		}
	}()
	select {
	case err = <-ready:
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		return nil, fmt.Errorf("%w%s", err, c.stderr.suffix())
	}
	return c, nil
}

// stat asks the child what it has used so far.
func (c *benchCluster) stat() (benchClusterStat, error) { return c.ask("stat") }

// gc has the child collect its garbage and give the memory back first.
func (c *benchCluster) gc() (benchClusterStat, error) { return c.ask("gc") }

// replace has the child replace its cluster by an empty one on the same
// ports, and answers as stat once the new one serves.
func (c *benchCluster) replace() (benchClusterStat, error) { return c.ask("replace") }

func (c *benchCluster) ask(what string) (benchClusterStat, error) {
	if _, err := io.WriteString(c.in, what+"\n"); err != nil {
		return benchClusterStat{}, fmt.Errorf("bench: cluster: %w%s", err, c.stderr.suffix())
	}
	line, err := c.out.ReadString('\n')
	var cpu, rss, peak, heap, sent, watches, at int64
	if why, ok := strings.CutPrefix(line, "error "); ok {
		return benchClusterStat{}, fmt.Errorf("bench: cluster: %s: %s", what, strings.TrimSpace(why))
	}
	if err == nil {
		_, err = fmt.Sscanf(line, "stat %d %d %d %d %d %d %d", &cpu, &rss, &peak, &heap, &sent, &watches, &at)
	}
	if err != nil {
		return benchClusterStat{}, fmt.Errorf("bench: cluster: reading its stats: %w%s", err, c.stderr.suffix())
	}
	return benchClusterStat{cpu: time.Duration(cpu), rss: rss, peak: peak, heap: heap, sent: sent, watches: watches, at: time.Unix(0, at)}, nil
}

// close ends the child (it exits when its stdin closes; killed if it has
// not within 10 s) and removes its data.
func (c *benchCluster) close() error {
	_ = c.in.Close()
	select {
	case <-c.exited:
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.exited
	}
	return os.RemoveAll(c.dir)
}

// benchTail keeps the last few KB written to it: the child's stderr, for
// the error that says why it failed.
type benchTail struct {
	mu sync.Mutex
	b  []byte
}

func (t *benchTail) Write(p []byte) (int, error) {
	const keep = 4 << 10
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > keep {
		t.b = t.b[len(t.b)-keep:]
	}
	return len(p), nil
}

// suffix is ": <what the child wrote>", or "" if nothing.
func (t *benchTail) suffix() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := strings.TrimSpace(string(t.b)); s != "" {
		return ": " + s
	}
	return ""
}
