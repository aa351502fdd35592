package coordtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/internal/testenv"
)

// selfEtcdEnv, when set, makes the test binary run as etcd (see TestMain):
// the process tests need no etcd binary but this one, an etcd of the
// version the module embeds.
const selfEtcdEnv = "COORDTEST_RUN_ETCD"

// etcdBinary is the binary the process tests run: COORD_TEST_ETCD if set,
// else this test binary, which runs as etcd.
func etcdBinary(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv(EtcdEnv); bin != "" {
		return bin
	}
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	err = exec.Command(bin, "--version").Run()
	if !errors.Is(err, syscall.ENOEXEC) {
		return bin
	}
	// Under user-mode emulation (how CI runs the other targets) the
	// kernel may not know how to run this binary by itself: a script runs
	// it under the same emulator.
	emu := etcdEmulator(t)
	script := filepath.Join(t.TempDir(), "etcd")
	if err := os.WriteFile(script, []byte("#!/bin/sh\nexec "+emu+" "+bin+` "$@"`+"\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	return script
}

// etcdEmulator is the path of the emulator that runs this binary where the
// kernel cannot by itself.
func etcdEmulator(t *testing.T) string {
	t.Helper()
	emu, err := exec.LookPath(testenv.Emulator())
	if err != nil {
		t.Fatalf("this binary cannot run by itself, and no emulator: %v", err)
	}
	return emu
}

func TestProcess(t *testing.T) {
	ctx := testCtx(t)
	p := NewProcess(t, etcdBinary(t), Config{})
	if ep := p.Endpoint(); !strings.HasPrefix(ep, "http://127.0.0.1:") {
		t.Errorf("Endpoint() = %q, want http://127.0.0.1:PORT", ep)
	}
	if v := p.Version(); !v.AtLeast(3, 4) {
		t.Errorf("Version() = %v", v)
	}
	mustGrantTTL(t, ctx, p.Client(), 1, 1)
	old := mustPut(t, ctx, p.Client(), "k", "1").Header.Revision
	last := mustPut(t, ctx, p.NewClient(t), "k", "2").Header.Revision
	if got := p.Revision(ctx); got != last {
		t.Fatalf("Revision() = %d, want %d", got, last)
	}
	if rev := p.Compact(ctx); rev != last {
		t.Fatalf("Compact() = %d, want %d", rev, last)
	}
	if again := p.Compact(ctx); again != last {
		t.Fatalf("second Compact() = %d, want %d", again, last)
	}
	if _, err := p.Client().Get(ctx, "k", clientv3.WithRev(old)); !errors.Is(err, rpctypes.ErrCompacted) {
		t.Errorf("Get at compacted revision: err = %v, want ErrCompacted", err)
	}

	// Through a proxy, across a crash and a restart: the data stays.
	pc := p.NewProxy(t).NewClient(t)
	p.Stop()
	p.Stop()
	sctx, cancel := context.WithTimeout(ctx, probeTimeout)
	_, err := pc.Get(sctx, "k")
	cancel()
	if err == nil {
		t.Fatal("Get on a stopped process succeeded")
	}
	p.Restart()
	if got, err := getValue(ctx, pc, "k"); err != nil || got != "2" {
		t.Fatalf("Get after Restart = %q, %v; want 2", got, err)
	}
}

func TestNewEtcd(t *testing.T) {
	ctx := testCtx(t)
	t.Run("embedded", func(t *testing.T) {
		t.Setenv(EtcdEnv, "")
		e := NewEtcd(t, Config{})
		if _, ok := e.(*Server); !ok {
			t.Fatalf("NewEtcd without %s = %T, want *Server", EtcdEnv, e)
		}
		mustPut(t, ctx, e.Client(), "k", "v")
	})
	t.Run("process", func(t *testing.T) {
		t.Setenv(EtcdEnv, etcdBinary(t))
		e := NewEtcd(t, Config{LeaseCheckpoint: true})
		if _, ok := e.(*Process); !ok {
			t.Fatalf("NewEtcd with %s = %T, want *Process", EtcdEnv, e)
		}
		mustPut(t, ctx, e.Client(), "k", "v")
	})
}

func TestNewProcessFails(t *testing.T) {
	ft := &fatalRecorder{TB: t}
	func() {
		defer func() { _ = recover() }()
		NewProcess(ft, "/nonexistent/etcd", Config{})
	}()
	if !strings.Contains(ft.msg, "/nonexistent/etcd") {
		t.Fatalf("failure = %q, want the binary named", ft.msg)
	}
}

// A process whose client port another server took between the pick and
// the bind must not take that server's answers for its own: its start
// fails as a port taken (NewProcess and Restart then pick again), and
// the stranger is left alone.
func TestProcessPortTakenByAnotherServer(t *testing.T) {
	other := NewServer(t)
	ports, err := testenv.LoopbackPorts(1)
	if err != nil {
		t.Fatal(err)
	}
	bin := etcdBinary(t)
	ver, err := BinaryVersion(bin)
	if err != nil {
		t.Fatal(err)
	}
	p := newProcess(t, bin, ver, Config{}, t.TempDir(), "default")
	p.clientURL = other.clientURL
	p.peerURL = loopbackURL("http", ports[0])
	p.initialCluster = "default=" + p.peerURL.String()
	p.clusterToken = "coordtest-taken"
	t.Cleanup(p.Close)
	err = p.startAndWait(time.Now().Add(readyTimeout))
	if !errors.Is(err, errPortTaken) {
		t.Fatalf("start on a port another etcd serves: err = %v, want errPortTaken", err)
	}
	if _, err := other.Client().Get(testCtx(t), "k"); err != nil {
		t.Fatalf("the other server after the failed start: %v", err)
	}
}

// fatalRecorder is a testing.TB whose Fatalf records the message and
// panics, to check a failure without failing the test.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(f)
}

func TestProcessCluster(t *testing.T) {
	ctx := testCtx(t)
	c := NewProcessCluster(t, etcdBinary(t), 3, Config{LeaseCheckpoint: true})
	ms := c.Members()
	if len(ms) != 3 || ms[0].Name() != "m0" {
		t.Fatalf("Members() = %v", ms)
	}
	mustPut(t, ctx, c.Client(), "k", "v")
	l := c.Leader(ctx)
	to := ms[0]
	if to == l {
		to = ms[1]
	}
	c.MoveLeader(ctx, to)
	if got := c.Leader(ctx); got != to {
		t.Fatalf("Leader() after MoveLeader = %s, want %s", got.Name(), to.Name())
	}

	// The leader crashes: the others elect another, and it rejoins.
	to.Stop()
	if got := c.Leader(ctx); got == to {
		t.Fatal("a stopped member leads")
	}
	mustPut(t, ctx, c.NewClient(t), "k", "w")
	to.Restart()
	if got, err := getValue(ctx, to.Client(), "k"); err != nil || got != "w" {
		t.Fatalf("Get on the restarted member = %q, %v; want w", got, err)
	}
	old := mustPut(t, ctx, c.Client(), "k", "x").Header.Revision - 1
	c.Compact(ctx)
	for _, m := range ms {
		if _, err := m.Client().Get(ctx, "k", clientv3.WithRev(old), clientv3.WithSerializable()); !errors.Is(err, rpctypes.ErrCompacted) {
			t.Errorf("member %s: Get at compacted revision: err = %v, want ErrCompacted", m.Name(), err)
		}
	}
}
