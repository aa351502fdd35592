package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-coord/coord"
	"github.com/go-coord/coord/coordtest"
	"github.com/go-coord/coord/internal/testenv"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(mainEnv) != "" {
		main() // exits
	}
	goleak.VerifyTestMain(m)
}

// mainEnv, when set, makes the test binary run coord's main with its
// arguments: a test that sends signals runs coord as a process so.
const mainEnv = "COORD_TEST_RUN_MAIN"

// scale stretches every deadline and time bound of the tests for slow
// machines (emulated CPUs), as in package coord's tests:
// COORD_TEST_SCALE=10 allows ten times longer.
var scale = testenv.Scale()

// waitLimit bounds every wait of the tests: generous, for slow machines.
var waitLimit = 20 * time.Second * scale

// dialTimeout is the --dial-timeout of the command lines the tests run
// that name their endpoints and no --dial-timeout: the default (2 s),
// stretched by scale. On riscv64 under emulation, in a cold CI run, a
// command's connection check missed the plain 2 s ("cannot reach etcd at
// ... within 2s"), in TestSemaphoreAndAcquire and TestTLS.
var dialTimeout = 2 * time.Second * scale

// withDialTimeout returns args with --dial-timeout dialTimeout appended if
// they name endpoints and no dial timeout.
func withDialTimeout(args []string) []string {
	named := false
	for _, a := range args {
		switch {
		case a == "--dial-timeout" || strings.HasPrefix(a, "--dial-timeout="):
			return args
		case a == "--endpoints" || strings.HasPrefix(a, "--endpoints="):
			named = true
		}
	}
	if !named {
		return args
	}
	return append(slices.Clip(args), "--dial-timeout", dialTimeout.String())
}

// newEtcd starts an embedded etcd for t, stopped when t ends, and returns
// it, its endpoint and a client of it.
func newEtcd(t *testing.T) (srv *coordtest.Server, ep string, cli *clientv3.Client) {
	srv = coordtest.NewServer(t)
	return srv, srv.Endpoint(), srv.NewClient(t)
}

// syncBuffer is a bytes.Buffer written by a running command and read by
// its test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// result is the outcome of a coord command line.
type result struct {
	code           int
	stdout, stderr string
	took           time.Duration
}

// runCoord runs a coord command line in-process, as main would.
func runCoord(t *testing.T, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitLimit)
	defer cancel()
	var stdout, stderr syncBuffer
	start := time.Now()
	code := run(ctx, withDialTimeout(args), &stdout, &stderr)
	return result{code, stdout.String(), stderr.String(), time.Since(start)}
}

// bgCoord is a coord command line running until its test interrupts it.
type bgCoord struct {
	args           []string
	cancel         context.CancelFunc
	done           chan result
	stdout, stderr *syncBuffer
	res            *result
}

// startCoord runs a coord command line in the background; stop interrupts
// it as Ctrl-C would. A cleanup interrupts it if the test did not.
func startCoord(t *testing.T, args ...string) *bgCoord {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &bgCoord{args: args, cancel: cancel, done: make(chan result, 1), stdout: &syncBuffer{}, stderr: &syncBuffer{}}
	go func() {
		start := time.Now()
		code := run(ctx, withDialTimeout(args), c.stdout, c.stderr)
		c.done <- result{code, c.stdout.String(), c.stderr.String(), time.Since(start)}
	}()
	t.Cleanup(func() { c.stop(t) })
	return c
}

// stop interrupts the command and returns its outcome.
func (c *bgCoord) stop(t *testing.T) result {
	t.Helper()
	c.cancel()
	return c.wait(t)
}

// wait waits for the command to end by itself.
func (c *bgCoord) wait(t *testing.T) result {
	t.Helper()
	if c.res != nil {
		return *c.res
	}
	select {
	case r := <-c.done:
		c.res = &r
		return r
	case <-time.After(waitLimit):
		t.Fatalf("coord %s: still running %v after being interrupted", strings.Join(c.args, " "), waitLimit)
		return result{}
	}
}

// waitOutput waits until the command's stdout (or stderr) contains want.
func (c *bgCoord) waitOutput(t *testing.T, stream *syncBuffer, want string) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for !strings.Contains(stream.String(), want) {
		select {
		case r := <-c.done:
			c.res = &r
			t.Fatalf("coord %s ended (status %d) before printing %q\nstdout:\n%s\nstderr:\n%s",
				strings.Join(c.args, " "), r.code, want, r.stdout, r.stderr)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("coord %s: no %q within %v\nstdout:\n%s\nstderr:\n%s",
				strings.Join(c.args, " "), want, waitLimit, c.stdout, c.stderr)
		}
	}
}

// eventually polls cond until it holds or waitLimit passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, waitLimit)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestUsage(t *testing.T) {
	t.Parallel()
	t.Run("coord -h prints the commands and connection flags on stdout and exits 0", func(t *testing.T) {
		r := runCoord(t, "-h")
		if r.code != exitOK || r.stderr != "" {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		for _, want := range []string{"Usage:", "demo", "hosts", "watch", "leader KEY", "campaign KEY IDENTITY", "semaphore KEY",
			"acquire KEY [IDENTITY]", "bench",
			"--endpoints", "--cacert", "--cert", "--key", "--user", "--dial-timeout", "--prefix", "Exit status"} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("usage lacks %q:\n%s", want, r.stdout)
			}
		}
	})
	t.Run("every command prints its help with -h, and with coord help", func(t *testing.T) {
		for _, c := range commands() {
			if c.name == "bench" {
				continue // its help is its owner's
			}
			for _, args := range [][]string{{c.name, "-h"}, {"help", c.name}, {c.name, "--help"}} {
				r := runCoord(t, args...)
				if r.code != exitOK || !strings.HasPrefix(r.stdout, "Usage: coord "+c.name) {
					t.Errorf("coord %s: status %d, stdout:\n%s\nstderr:\n%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
				}
			}
		}
	})
	t.Run("usage errors exit 2 with a message, before dialling", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{nil, "no command given"},
			{[]string{"frobnicate"}, `unknown command "frobnicate"`},
			{[]string{"help", "frobnicate"}, `unknown command "frobnicate"`},
			{[]string{"--bogus", "hosts"}, "flag provided but not defined"},
			{[]string{"hosts", "--bogus"}, "flag provided but not defined"},
			{[]string{"hosts", "--dial-timeout", "soon"}, "invalid value"},
			{[]string{"--dial-timeout", "0s", "hosts"}, "--dial-timeout must be positive"},
			{[]string{"hosts", "extra"}, `unexpected argument "extra"`},
			{[]string{"hosts", "-o", "yaml"}, `-o "yaml": want table or json`},
			{[]string{"watch", "-o", "table"}, `-o "table": want text or json`},
			{[]string{"hosts", "--prefix", "/coord/hosts"}, "must end in /"},
			{[]string{"hosts", "--endpoints", " , "}, "no endpoint given"},
			{[]string{"hosts", "--cert", "c.pem"}, "--cert and --key go together"},
			{[]string{"hosts", "--user", "root"}, "--user wants user:password"},
			{[]string{"hosts", "--user", "root:pw", "--password", "pw"}, "password given twice"},
			{[]string{"hosts", "--password", "pw"}, "--password given without --user"},
			{[]string{"leader"}, "missing arguments: want KEY"},
			{[]string{"leader", "a", "b"}, "too many arguments"},
			{[]string{"leader", "/elections/x/"}, "no trailing /"},
			{[]string{"campaign", "/elections/x"}, "missing arguments: want KEY IDENTITY"},
			{[]string{"campaign", "/elections/x", "id", "--ttl", "1500ms"}, "whole number of seconds"},
			{[]string{"campaign", "--prefix", "/p/", "/elections/x", "id"}, "flag provided but not defined: -prefix"},
			{[]string{"semaphore"}, "missing arguments: want KEY"},
			{[]string{"semaphore", "/s//x"}, "no //"},
			{[]string{"acquire", "/s/x"}, "--limit is required: how many permits of /s/x are held at once"},
			{[]string{"acquire", "/s/x", "--limit", "-1"}, "--limit -1: want at least 1"},
			{[]string{"campaign", "/elections/x", "id", "--ttl", "2"}, "want a duration such as 2s"},
			{[]string{"hosts", "--dial-timeout", "3"}, "want a duration such as 2s"},
			{[]string{"acquire", "/s/x", "id", "extra", "--limit", "1"}, "too many arguments: want KEY [IDENTITY]"},
			{[]string{"acquire", "/s/x", "--limit", "1", "--ttl", "0s"}, "whole number of seconds"},
			{[]string{"acquire", "/s/x/", "--limit", "1"}, "no trailing /"},
			{[]string{"demo", "--endpoints", " , "}, "no endpoint given"},
			{[]string{"demo", "now"}, `unexpected argument "now"`},
		} {
			r := runCoord(t, tc.args...)
			if r.code != exitUsage || !strings.Contains(r.stderr, tc.want) || !strings.Contains(r.stderr, "for usage") {
				t.Errorf("coord %s: status %d, want %d; stderr %q, want it to say %q", strings.Join(tc.args, " "), r.code, exitUsage, r.stderr, tc.want)
			}
			if r.took > time.Second*scale {
				t.Errorf("coord %s: took %v", strings.Join(tc.args, " "), r.took)
			}
		}
	})
	t.Run("bench is a command", func(t *testing.T) {
		if _, ok := lookup("bench"); !ok {
			t.Fatal("coord bench is not routed")
		}
	})
}

func TestErrorLine(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"a library error is printed as it is", fmt.Errorf("coord: register host %q: grant lease: %w", "a", context.DeadlineExceeded),
			`coord: register host "a": grant lease: context deadline exceeded`},
		{"a library sentinel says coord once", coord.ErrNoLeader, "coord: no leader"},
		{"the command's own error gets the prefix", errors.New("election /e has no leader"), "coord: election /e has no leader"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := errorLine(tc.err); got != tc.want {
				t.Errorf("errorLine = %q, want %q", got, tc.want)
			}
		})
	}
}
