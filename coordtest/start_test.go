package coordtest

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

// mustStart starts a Standalone in a fresh directory; the test's cleanup
// closes it (again, if the test did).
func mustStart(t *testing.T) *Standalone {
	t.Helper()
	s, err := Start(t.TempDir(), Config{})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// wantErr checks that err is a coordtest error whose message contains want.
func wantErr(t *testing.T, what string, err error, want string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error, want one containing %q", what, want)
	}
	if msg := err.Error(); !strings.HasPrefix(msg, "coordtest: ") || !strings.Contains(msg, want) {
		t.Fatalf("%s: error %q, want \"coordtest: ...%s...\"", what, msg, want)
	}
}

func TestStart(t *testing.T) {
	t.Run("serves outside a test and Close leaves no goroutine", func(t *testing.T) {
		ignore := goleak.IgnoreCurrent()
		ctx := testCtx(t)
		dir := filepath.Join(t.TempDir(), "not", "there")
		s, err := Start(dir, Config{})
		if err != nil {
			t.Fatalf("Start: %v", err)
		}
		if data, _ := filepath.Glob(filepath.Join(dir, "etcd-*", "member")); len(data) != 1 {
			t.Errorf("data directories in %s: %v, want one", dir, data)
		}
		if ep := s.Endpoint(); !strings.HasPrefix(ep, "http://127.0.0.1:") {
			t.Errorf("Endpoint() = %q, want http://127.0.0.1:PORT", ep)
		}
		if eps := s.ClientConfig().Endpoints; len(eps) != 1 || eps[0] != s.Endpoint() {
			t.Errorf("ClientConfig().Endpoints = %v, want [%s]", eps, s.Endpoint())
		}
		shared := s.Client()
		if shared != s.Client() {
			t.Error("Client() returned different clients")
		}
		mustPut(t, ctx, shared, "k", "v")
		own, err := s.Dial()
		if err != nil {
			t.Fatalf("Dial: %v", err)
		}
		if own == shared {
			t.Error("Dial returned the shared client")
		}
		if got, err := getValue(ctx, own, "k"); err != nil || got != "v" {
			t.Fatalf("Get = %q, %v; want v", got, err)
		}
		mustGrantTTL(t, ctx, own, 1, 1)

		s.Close()
		if shared.Ctx().Err() == nil {
			t.Error("Client still open after Close")
		}
		if own.Ctx().Err() == nil {
			t.Error("Dial client still open after Close")
		}
		goleak.VerifyNone(t, ignore)
		if data, _ := filepath.Glob(filepath.Join(dir, "etcd-*", "member")); len(data) != 1 {
			t.Errorf("data directories in %s after Close: %v, want the server's, kept", dir, data)
		}
	})

	t.Run("Close is idempotent and safe concurrently", func(t *testing.T) {
		ignore := goleak.IgnoreCurrent()
		s, err := Start(t.TempDir(), Config{})
		if err != nil {
			t.Fatalf("Start: %v", err)
		}
		own, err := s.Dial()
		if err != nil {
			t.Fatalf("Dial: %v", err)
		}
		var wg sync.WaitGroup
		for i := 0; i < 3; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s.Close()
			}()
		}
		wg.Wait()
		// Every call returned once the first was done.
		if own.Ctx().Err() == nil || s.Client().Ctx().Err() == nil {
			t.Error("clients still open after concurrent Closes returned")
		}
		s.Close()
		goleak.VerifyNone(t, ignore)
	})

	t.Run("Stop, Restart, Revision and Compact", func(t *testing.T) {
		ctx := testCtx(t)
		s := mustStart(t)
		c, err := s.Dial()
		if err != nil {
			t.Fatalf("Dial: %v", err)
		}
		put := mustPut(t, ctx, c, "k", "v")
		if rev, err := s.Revision(ctx); err != nil || rev != put.Header.Revision {
			t.Fatalf("Revision() = %d, %v; want %d", rev, err, put.Header.Revision)
		}
		if rev, err := s.Compact(ctx); err != nil || rev != put.Header.Revision {
			t.Fatalf("Compact() = %d, %v; want %d", rev, err, put.Header.Revision)
		}

		s.Stop()
		s.Stop() // idempotent
		_, err = s.Revision(ctx)
		wantErr(t, "Revision on a stopped server", err, "server is stopped")
		_, err = s.Compact(ctx)
		wantErr(t, "Compact on a stopped server", err, "server is stopped")

		if err := s.Restart(); err != nil {
			t.Fatalf("Restart: %v", err)
		}
		waitValue(t, ctx, c, "k", "v", "after Restart")
		if rev, err := s.Revision(ctx); err != nil || rev != put.Header.Revision {
			t.Errorf("Revision after Restart = %d, %v; want %d", rev, err, put.Header.Revision)
		}
	})

	t.Run("returns errors once closed", func(t *testing.T) {
		ctx := testCtx(t)
		s := mustStart(t)
		s.Close()
		err := s.Restart()
		wantErr(t, "Restart after Close", err, "Restart called after the server was closed")
		_, err = s.Revision(ctx)
		wantErr(t, "Revision after Close", err, "the server was closed")
		_, err = s.Compact(ctx)
		wantErr(t, "Compact after Close", err, "the server was closed")
		_, err = s.Dial()
		wantErr(t, "Dial after Close", err, "client requested after the server was closed")
		s.Stop() // harmless
		if _, err := s.Client().Get(ctx, "k"); err == nil {
			t.Error("Get through Client after Close succeeded")
		}
	})

	t.Run("does not need the directory to be empty", func(t *testing.T) {
		dir := t.TempDir()
		for i := 0; i < 2; i++ {
			s, err := Start(dir, Config{})
			if err != nil {
				t.Fatalf("Start #%d on %s: %v", i+1, dir, err)
			}
			s.Close()
		}
		if data, _ := filepath.Glob(filepath.Join(dir, "etcd-*", "member")); len(data) != 2 {
			t.Errorf("data directories in %s: %v, want both servers'", dir, data)
		}
	})

	t.Run("returns an error and leaves nothing behind when it cannot start", func(t *testing.T) {
		ignore := goleak.IgnoreCurrent()
		file := filepath.Join(t.TempDir(), "file")
		if err := os.WriteFile(file, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		s, err := Start(filepath.Join(file, "dir"), Config{})
		if err == nil {
			s.Close()
		}
		wantErr(t, "Start under a regular file", err, "creating data directory")
		// etcd refuses an election timeout shorter than 5 heartbeats.
		s, err = Start(t.TempDir(), Config{TickMs: 100, ElectionMs: 200})
		if err == nil {
			s.Close()
		}
		wantErr(t, "Start with ElectionMs < 5*TickMs", err, "starting etcd")
		goleak.VerifyNone(t, ignore)
	})
}

func TestServerCloseEarly(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	c := s.NewClient(t)
	mustPut(t, ctx, c, "k", "v")
	s.Close() // the cleanup closes it again, harmlessly
	if c.Ctx().Err() == nil {
		t.Error("NewClient client still open after Close")
	}
	if _, err := newTrackedClient(s.ClientConfig(), s); err == nil {
		t.Error("client registered after Close")
	}
}

func TestStartAt(t *testing.T) {
	ctx := testCtx(t)
	dir := filepath.Join(t.TempDir(), "data")
	x, err := StartAt(dir, "127.0.0.1:0", Config{})
	if err != nil {
		t.Fatal(err)
	}
	if ep := x.Endpoint(); !strings.HasPrefix(ep, "http://127.0.0.1:") || strings.HasSuffix(ep, ":0") {
		t.Errorf("Endpoint() = %q, want the port picked", ep)
	}
	mustPut(t, ctx, x.Client(), "k", "kept")
	x.Close()

	// The data stays in dir itself, for the next one.
	if _, err := os.Stat(filepath.Join(dir, "member")); err != nil {
		t.Fatalf("no etcd data in %s: %v", dir, err)
	}
	y, err := StartAt(dir, "127.0.0.1:0", Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer y.Close()
	if got, err := getValue(ctx, y.Client(), "k"); err != nil || got != "kept" {
		t.Fatalf("Get after a restart on the same data = %q, %v; want kept", got, err)
	}

	if _, err := StartAt(dir, "no-port", Config{}); err == nil || !strings.HasPrefix(err.Error(), "coordtest: ") {
		t.Errorf("StartAt on a bad address: %v", err)
	}
}
