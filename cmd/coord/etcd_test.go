package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/internal/testenv"
)

// startDevEtcd runs coord etcd with args on a free port and returns it
// with the endpoint it printed.
func startDevEtcd(t *testing.T, args ...string) (*bgCoord, string) {
	t.Helper()
	c := startCoord(t, append([]string{"etcd", "--listen", "127.0.0.1:0"}, args...)...)
	c.waitOutput(t, c.stdout, "\n")
	ep := strings.TrimSpace(strings.SplitN(c.stdout.String(), "\n", 2)[0])
	if !strings.HasPrefix(ep, "http://127.0.0.1:") || strings.HasSuffix(ep, ":0") {
		t.Fatalf("first line of stdout %q, want the endpoint http://127.0.0.1:PORT", ep)
	}
	c.waitOutput(t, c.stderr, "Ctrl-C to stop")
	return c, ep
}

// dialDev returns a client of the endpoint, closed at the end of the test.
func dialDev(t *testing.T, ep string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: waitLimit})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// stopDev interrupts coord etcd, checks that it ends with status 0 and
// that its port is closed.
func stopDev(t *testing.T, c *bgCoord, ep string) {
	t.Helper()
	if r := c.stop(t); r.code != exitOK {
		t.Fatalf("coord etcd ended with status %d\nstderr:\n%s", r.code, r.stderr)
	}
	if conn, err := net.Dial("tcp", strings.TrimPrefix(ep, "http://")); err == nil {
		conn.Close()
		t.Fatalf("%s still accepts connections after coord etcd ended", ep)
	}
}

func TestEtcd(t *testing.T) {
	t.Run("serves until interrupted, then removes its data", func(t *testing.T) {
		c, ep := startDevEtcd(t)
		cli := dialDev(t, ep)
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		if _, err := cli.Put(ctx, "k", "v"); err != nil {
			t.Fatal(err)
		}
		resp, err := cli.Get(ctx, "k")
		if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
			t.Fatalf("Get = %v, %v; want v", resp, err)
		}
		// Tuned for trying things: etcd grants a 1 s lease as asked.
		lease, err := cli.Grant(ctx, 1)
		if err != nil || lease.TTL != 1 {
			t.Fatalf("Grant(1) = %v, %v; want a TTL of 1", lease, err)
		}
		dir := between(c.stderr.String(), "data in ", ",")
		if _, err := os.Stat(dir); err != nil {
			t.Fatalf("data directory %q: %v", dir, err)
		}
		stopDev(t, c, ep)
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Fatalf("data directory %q left behind: %v", dir, err)
		}
	})

	t.Run("keeps its data in --data-dir across runs", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "etcd")
		c, ep := startDevEtcd(t, "--data-dir", dir)
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		if _, err := dialDev(t, ep).Put(ctx, "k", "kept"); err != nil {
			t.Fatal(err)
		}
		stopDev(t, c, ep)

		c, ep = startDevEtcd(t, "--data-dir", dir)
		resp, err := dialDev(t, ep).Get(ctx, "k")
		if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "kept" {
			t.Fatalf("Get after a restart = %v, %v; want kept", resp, err)
		}
		stopDev(t, c, ep)
	})

	t.Run("fails on an address it cannot serve", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		for _, addr := range []string{"no-port", l.Addr().String()} {
			r := runCoord(t, "etcd", "--listen", addr)
			if r.code != exitError || !strings.HasPrefix(r.stderr, "coord: ") {
				t.Errorf("coord etcd --listen %s: status %d, stderr %q; want 1 and an error", addr, r.code, r.stderr)
			}
		}
	})

	t.Run("ends cleanly on SIGINT and SIGTERM", func(t *testing.T) {
		for _, sig := range []os.Signal{os.Interrupt, syscall.SIGTERM} {
			cmd, out, stderr := startMain(t, "etcd", "--listen", "127.0.0.1:0")
			t.Cleanup(func() { cmd.Process.Kill() })
			line, err := bufio.NewReader(out).ReadString('\n')
			if err != nil {
				t.Fatalf("reading the endpoint: %v\nstderr:\n%s", err, stderr.String())
			}
			ep := strings.TrimSpace(line)
			ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
			defer cancel()
			if _, err := dialDev(t, ep).Put(ctx, "k", "v"); err != nil {
				t.Fatal(err)
			}
			if err := cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			if err := cmd.Wait(); err != nil {
				t.Fatalf("coord etcd after %v: %v\nstderr:\n%s", sig, err, stderr.String())
			}
			if !strings.Contains(stderr.String(), "coord etcd: stopping") {
				t.Errorf("stderr after %v:\n%s", sig, stderr.String())
			}
		}
	})

	t.Run("refuses arguments", func(t *testing.T) {
		if r := runCoord(t, "etcd", "now"); r.code != exitUsage {
			t.Errorf("coord etcd now: status %d, want %d", r.code, exitUsage)
		}
	})
}

// startMain runs coord's main in a process of its own (this test binary,
// under the emulator if the kernel cannot run it by itself) and returns
// it with its stdout and stderr.
func startMain(t *testing.T, args ...string) (*exec.Cmd, io.Reader, *syncBuffer) {
	t.Helper()
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := func(name string, args ...string) (*exec.Cmd, io.Reader, *syncBuffer, error) {
		cmd := exec.Command(name, args...)
		cmd.Env = append(os.Environ(), mainEnv+"=1")
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, nil, nil, err
		}
		stderr := &syncBuffer{}
		cmd.Stderr = stderr
		return cmd, out, stderr, cmd.Start()
	}
	cmd, out, stderr, err := start(bin, args...)
	if errors.Is(err, syscall.ENOEXEC) {
		emu, lerr := exec.LookPath(testenv.Emulator())
		if lerr != nil {
			t.Fatalf("running coord: %v; no emulator: %v", err, lerr)
		}
		cmd, out, stderr, err = start(emu, append([]string{bin}, args...)...)
	}
	if err != nil {
		t.Fatalf("running coord: %v", err)
	}
	return cmd, out, stderr
}

// between returns the text of s between the first before and the next
// after; "" if there is none.
func between(s, before, after string) string {
	_, rest, ok := strings.Cut(s, before)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, after)
	return v
}
