package coordtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/internal/testenv"
)

// EtcdEnv names the environment variable that NewEtcd reads: the path of an
// etcd binary to run as a Process instead of an embedded Server.
const EtcdEnv = "COORD_TEST_ETCD"

const (
	// readyPoll is the interval at which a starting process is probed.
	readyPoll = 20 * time.Millisecond
	// probeTimeout bounds one readiness probe.
	probeTimeout = 500 * time.Millisecond
	// processLogTail is how much of a process's log a failure quotes.
	processLogTail = 2 << 10
)

// Etcd is what a Server and a Process have in common: a single-member etcd
// for a test, with the same lifetime and failure contracts. Tests written
// against it run on the embedded server or on an etcd binary alike.
type Etcd interface {
	Endpoint() string
	ClientConfig() clientv3.Config
	Client() *clientv3.Client
	NewClient(t testing.TB) *clientv3.Client
	NewProxy(t testing.TB) *Proxy
	Stop()
	Restart()
	Revision(ctx context.Context) int64
	Compact(ctx context.Context) int64
}

var (
	_ Etcd = (*Server)(nil)
	_ Etcd = (*Process)(nil)
)

// NewEtcd starts a single-member etcd tuned by cfg: a Process of the
// binary named by the environment variable COORD_TEST_ETCD if it is set, an
// embedded Server otherwise.
func NewEtcd(t testing.TB, cfg Config) Etcd {
	t.Helper()
	if bin := os.Getenv(EtcdEnv); bin != "" {
		return NewProcess(t, bin, cfg)
	}
	return NewServerWith(t, cfg)
}

// Process is an etcd binary run as a child process of the test: the
// surface of a Server (clients, proxies, Stop, Restart, Revision, Compact)
// on a real etcd of any version, for compatibility tests. Create it with
// NewProcess, or as a member of a ProcessCluster. It listens on loopback
// ports picked free, keeps its data in a subdirectory of t.TempDir(), and
// is tuned as a Server is (Config's TickMs and ElectionMs become
// --heartbeat-interval and --election-timeout, so the minimum lease TTL is
// 1 s); its log (stdout and stderr) goes to a file beside its data, quoted
// when it fails to start. Its ports and data directory are fixed for its
// whole life, across Stop and Restart.
//
// The process is killed by the test's cleanup; on Linux it is also killed
// when the test binary dies (the parent-death signal), so that no etcd
// outlives a crashed or killed test. The lifetime and failure contracts of
// Server apply otherwise. All methods are safe for concurrent use.
type Process struct {
	t   testing.TB
	bin string
	ver Version
	cfg Config
	// Fixed before the first start.
	name           string
	dir            string
	logPath        string
	clientURL      url.URL
	peerURL        url.URL
	initialCluster string
	clusterToken   string

	// lifeMu serialises starting and stopping and guards the fields below.
	lifeMu sync.Mutex
	cmd    *exec.Cmd     // nil while stopped
	exited chan struct{} // closed once cmd has exited
	done   bool          // Close has run; never start again

	closeOnce sync.Once

	owner // what Close closes before killing the process
}

// NewProcess runs the etcd binary bin as a single-member etcd tuned by cfg
// (its Logger is not used: the log goes to a file) and waits (up to 30 s)
// until it is ready to serve. It fails the test with t.Fatal if the binary
// cannot be run or the server does not become ready, quoting the end of
// its log. A t.Cleanup calls Close.
func NewProcess(t testing.TB, bin string, cfg Config) *Process {
	t.Helper()
	ver, err := BinaryVersion(bin)
	if err != nil {
		t.Fatalf("coordtest: %v", err)
	}
	base := t.TempDir()
	var p *Process
	for attempt := 0; attempt < portAttempts; attempt++ {
		ports, perr := testenv.LoopbackPorts(2)
		if perr != nil {
			t.Fatalf("coordtest: %v", perr)
		}
		p = newProcess(t, bin, ver, cfg, filepath.Join(base, fmt.Sprintf("etcd-%d", attempt)), "default")
		p.clientURL = loopbackURL("http", ports[0])
		p.peerURL = loopbackURL("http", ports[1])
		p.initialCluster = "default=" + p.peerURL.String()
		p.clusterToken = fmt.Sprintf("coordtest-%d", attempt)
		if err = p.startAndWait(time.Now().Add(readyTimeout)); err == nil || !errors.Is(err, errPortTaken) {
			break
		}
		p.Close()
	}
	t.Cleanup(p.Close)
	if err != nil {
		t.Fatalf("coordtest: %v", err)
	}
	return p
}

func newProcess(t testing.TB, bin string, ver Version, cfg Config, dir, name string) *Process {
	return &Process{
		t: t, bin: bin, ver: ver, cfg: cfg.withDefaults(),
		name: name, dir: filepath.Join(dir, "data"), logPath: filepath.Join(dir, "etcd.log"),
		owner: owner{gone: "the process was closed"},
	}
}

// Name returns the process's member name: "default" for NewProcess, "m0",
// "m1", ... in a ProcessCluster.
func (p *Process) Name() string { return p.name }

// Version returns the version of the etcd binary.
func (p *Process) Version() Version { return p.ver }

// Endpoint returns the client URL of the process, "http://127.0.0.1:PORT".
// It does not change across Stop and Restart.
func (p *Process) Endpoint() string { return p.clientURL.String() }

// ClientConfig is Server.ClientConfig for the process.
func (p *Process) ClientConfig() clientv3.Config { return clientConfig(p.Endpoint()) }

// Client is Server.Client for the process.
func (p *Process) Client() *clientv3.Client {
	p.t.Helper()
	return p.clientFor(p.t, p.ClientConfig(), "Process", p.Endpoint())
}

// NewClient is Server.NewClient for the process.
func (p *Process) NewClient(t testing.TB) *clientv3.Client {
	t.Helper()
	return newTestClient(t, p.ClientConfig(), p)
}

// NewProxy is Server.NewProxy for the process.
func (p *Process) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	return newProxy(t, p.clientURL, p)
}

// Stop kills the process (SIGKILL), as a crash would: in-flight requests
// fail, connections reset, a leader hands nothing over. It returns once the
// process has exited. Clients stay open and reconnect after Restart. Stop
// is idempotent. As with a Server, leases do not expire while it is
// stopped: on restart etcd renews every lease for its full TTL.
func (p *Process) Stop() {
	p.lifeMu.Lock()
	defer p.lifeMu.Unlock()
	p.stopLocked()
}

// Restart kills the process if it is running and runs it again on the same
// data directory and ports. It returns once the server is ready to serve
// (a member of a ProcessCluster: once it has rejoined, which needs a
// quorum). If a port is still in use it retries for up to 5 s. It fails
// the test on error, including when called after Close.
func (p *Process) Restart() {
	p.t.Helper()
	if err := p.restart(); err != nil {
		p.t.Fatalf("coordtest: %v", err)
	}
}

func (p *Process) restart() error {
	deadline := time.Now().Add(rebindTimeout)
	for {
		err := p.startAndWait(time.Now().Add(readyTimeout))
		if err == nil || !errors.Is(err, errPortTaken) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(rebindPoll)
	}
}

// Revision is Server.Revision for the process: the current revision, read
// linearizably.
func (p *Process) Revision(ctx context.Context) int64 {
	p.t.Helper()
	rev, err := p.revision(ctx)
	if err != nil {
		p.t.Fatalf("coordtest: %v", err)
	}
	return rev
}

// Compact is Server.Compact for the process: it compacts at the current
// revision, waits until the compaction is physically applied, and returns
// that revision.
func (p *Process) Compact(ctx context.Context) int64 {
	p.t.Helper()
	rev, err := compactAt(ctx, p.Client())
	if err != nil {
		p.t.Fatalf("coordtest: %v", err)
	}
	return rev
}

func (p *Process) revision(ctx context.Context) (int64, error) {
	cli, err := p.sharedClient(p.ClientConfig())
	if err != nil {
		return 0, fmt.Errorf("reading revision: %w", err)
	}
	resp, err := cli.Get(ctx, "\x00", clientv3.WithCountOnly())
	if err != nil {
		return 0, fmt.Errorf("reading revision: %w", err)
	}
	return resp.Header.Revision, nil
}

// compactAt compacts the store of cli at its current revision, physically.
func compactAt(ctx context.Context, cli *clientv3.Client) (int64, error) {
	resp, err := cli.Get(ctx, "\x00", clientv3.WithCountOnly())
	if err != nil {
		return 0, fmt.Errorf("reading revision: %w", err)
	}
	rev := resp.Header.Revision
	_, err = cli.Compact(ctx, rev, clientv3.WithCompactPhysical())
	if err != nil && !errors.Is(err, rpctypes.ErrCompacted) {
		return 0, fmt.Errorf("compacting at revision %d: %w", rev, err)
	}
	return rev, nil
}

// Close closes every client and proxy handed out by the process, then
// kills it, and returns once it has exited. It cannot be restarted
// afterwards. Close is idempotent.
func (p *Process) Close() {
	p.closeOnce.Do(func() {
		proxies := p.closeClients()
		p.lifeMu.Lock()
		p.done = true
		p.stopLocked()
		p.lifeMu.Unlock()
		for _, px := range proxies {
			px.close()
		}
	})
}

// errPortTaken marks a start that failed because a port was in use.
var errPortTaken = errors.New("a port is in use")

// startAndWait runs the process and waits until it is ready, or fails.
func (p *Process) startAndWait(deadline time.Time) error {
	if err := p.start(); err != nil {
		return err
	}
	return p.waitReady(deadline)
}

// start runs the process (killing a running one first) without waiting.
func (p *Process) start() error {
	p.lifeMu.Lock()
	defer p.lifeMu.Unlock()
	if p.done {
		return errors.New("starting etcd: the process was closed")
	}
	p.stopLocked()
	if err := os.MkdirAll(filepath.Dir(p.logPath), 0o700); err != nil {
		return fmt.Errorf("starting etcd: %w", err)
	}
	log, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("starting etcd: %w", err)
	}
	defer log.Close() // the child has its own copy
	cmd := exec.Command(p.bin, p.flags()...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", p.bin, err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // a kill is how it ends; its status says nothing more
		close(exited)
	}()
	p.cmd, p.exited = cmd, exited
	return nil
}

// waitReady probes the process until it serves a linearizable read, it
// exits, or the deadline passes; on failure it kills it. An answer counts
// only from a server that lists our peer URL among its members: the
// client port, free when it was picked, may have been taken since by
// another test's server, which would answer the probe while this process
// exits with "address already in use" (a test then ran on a stranger's
// server, and a Stop did not stop what it talked to).
func (p *Process) waitReady(deadline time.Time) error {
	p.lifeMu.Lock()
	exited := p.exited
	p.lifeMu.Unlock()
	if exited == nil {
		return errors.New("starting etcd: the process was stopped")
	}
	cli, err := clientv3.New(p.ClientConfig())
	if err != nil {
		return fmt.Errorf("probing etcd on %s: %w", p.Endpoint(), err)
	}
	defer cli.Close()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		_, err = cli.Get(ctx, "health")
		if err == nil {
			err = p.isOurs(ctx, cli)
		}
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return p.startFailure("exited before becoming ready")
		case <-time.After(readyPoll):
		}
		if time.Now().After(deadline) {
			p.Stop()
			return p.startFailure(fmt.Sprintf("not ready after %v (%v)", readyTimeout, err))
		}
	}
}

// isOurs fails unless the server cli reaches lists our peer URL among its
// members: it is this process (or, in a cluster, reaches it).
func (p *Process) isOurs(ctx context.Context, cli *clientv3.Client) error {
	resp, err := cli.MemberList(ctx)
	if err != nil {
		return err
	}
	for _, m := range resp.Members {
		if slices.Contains(m.PeerURLs, p.peerURL.String()) {
			return nil
		}
	}
	return fmt.Errorf("another etcd answers on %s (no member has peer URL %s)", p.Endpoint(), p.peerURL.String())
}

// startFailure is the error of a start that failed: what happened and the
// end of the log; it wraps errPortTaken when the log says a port was in use.
func (p *Process) startFailure(what string) error {
	return logFailure(p.logPath, fmt.Sprintf("etcd %s (%s) on %s %s", p.ver, p.bin, p.Endpoint(), what))
}

// logFailure is the error of a child process that failed to start, as
// failed says, quoting the end of its log at logPath; it wraps
// errPortTaken when the log says a port was in use.
func logFailure(logPath, failed string) error {
	data, _ := os.ReadFile(logPath)
	tail := string(data)
	if len(tail) > processLogTail {
		tail = "..." + tail[len(tail)-processLogTail:]
	}
	err := fmt.Errorf("%s; its log ends:\n%s", failed, tail)
	if strings.Contains(tail, "address already in use") {
		return fmt.Errorf("%w: %w", errPortTaken, err)
	}
	return err
}

// stopLocked kills the running process, if any, and waits for it to exit.
// lifeMu must be held.
func (p *Process) stopLocked() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill() // fails only if it has exited already
	<-p.exited
	p.cmd, p.exited = nil, nil
}

// running reports whether the process is running.
func (p *Process) running() bool {
	p.lifeMu.Lock()
	defer p.lifeMu.Unlock()
	return p.cmd != nil
}

// flags returns the command line of the process: its URLs and data, and
// the tuning of a Server in the flags its version accepts.
func (p *Process) flags() []string {
	f := []string{
		"--name=" + p.name,
		"--data-dir=" + p.dir,
		"--listen-client-urls=" + p.Endpoint(),
		"--advertise-client-urls=" + p.Endpoint(),
		"--listen-peer-urls=" + p.peerURL.String(),
		"--initial-advertise-peer-urls=" + p.peerURL.String(),
		"--initial-cluster=" + p.initialCluster,
		"--initial-cluster-token=" + p.clusterToken,
		"--initial-cluster-state=new",
		"--heartbeat-interval=" + strconv.FormatUint(uint64(p.cfg.TickMs), 10),
		"--election-timeout=" + strconv.FormatUint(uint64(p.cfg.ElectionMs), 10),
		"--auto-compaction-retention=0",
		"--logger=zap",
		"--log-level=error",
	}
	if p.ver.AtLeast(3, 5) {
		f = append(f, "--unsafe-no-fsync")
	}
	if p.cfg.LeaseCheckpoint {
		f = append(f, p.ver.leaseCheckpointFlag())
	}
	return f
}

// Version is the version of an etcd binary.
type Version struct{ Major, Minor, Patch int }

func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Patch) }

// AtLeast reports whether v is major.minor or later.
func (v Version) AtLeast(major, minor int) bool {
	return v.Major > major || v.Major == major && v.Minor >= minor
}

// leaseCheckpointFlag is the flag that turns lease checkpointing on: an
// experimental flag up to 3.5, a feature gate from 3.6 on.
func (v Version) leaseCheckpointFlag() string {
	if v.AtLeast(3, 6) {
		return "--feature-gates=LeaseCheckpoint=true"
	}
	return "--experimental-enable-lease-checkpoint"
}

var (
	versionsMu sync.Mutex
	versions   = map[string]Version{} // by binary path: each is run once
	versionRE  = regexp.MustCompile(`etcd Version: (\d+)\.(\d+)\.(\d+)`)
)

// BinaryVersion runs bin --version and returns the version it prints.
func BinaryVersion(bin string) (Version, error) {
	versionsMu.Lock()
	defer versionsMu.Unlock()
	if v, ok := versions[bin]; ok {
		return v, nil
	}
	out, err := exec.Command(bin, "--version").CombinedOutput()
	if err != nil {
		return Version{}, fmt.Errorf("running %s --version: %w: %s", bin, err, out)
	}
	m := versionRE.FindStringSubmatch(string(out))
	if m == nil {
		return Version{}, fmt.Errorf("%s --version: no version in %q", bin, out)
	}
	var v Version
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	v.Patch, _ = strconv.Atoi(m[3])
	versions[bin] = v
	return v, nil
}
