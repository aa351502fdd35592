package coordtest

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

// mustPanic calls f and checks that it panics with the message want.
func mustPanic(t *testing.T, want string, f func()) {
	t.Helper()
	defer func() {
		t.Helper()
		got := recover()
		if got == nil {
			t.Fatalf("no panic, want %q", want)
		}
		if msg := fmt.Sprint(got); msg != want {
			t.Fatalf("panic %q, want %q", msg, want)
		}
	}()
	f()
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
		if _, err := s.Client().Put(ctx, "k", "v"); err != nil {
			t.Fatalf("Put: %v", err)
		}
		own, err := s.Dial()
		if err != nil {
			t.Fatalf("Dial: %v", err)
		}
		if own == s.Client() {
			t.Error("Dial returned the shared client")
		}
		if got, err := getValue(ctx, own, "k"); err != nil || got != "v" {
			t.Fatalf("Get = %q, %v; want v", got, err)
		}
		if resp, err := own.Grant(ctx, 1); err != nil || resp.TTL != 1 {
			t.Fatalf("Grant(1) = %v, %v; want TTL 1", resp, err)
		}
		// A proxy tied to a test is closed by Close all the same.
		p := s.NewProxy(t)
		if got, err := getValue(ctx, p.NewClient(t), "k"); err != nil || got != "v" {
			t.Fatalf("Get through proxy = %q, %v; want v", got, err)
		}

		s.Close()
		if own.Ctx().Err() == nil {
			t.Error("Dial client still open after Close")
		}
		if _, err := s.Dial(); err == nil {
			t.Error("Dial succeeded after Close")
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
		if _, err := s.Dial(); err != nil {
			t.Fatalf("Dial: %v", err)
		}
		_ = s.Client()
		var wg sync.WaitGroup
		for i := 0; i < 3; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s.Close()
			}()
		}
		wg.Wait()
		s.Close()
		goleak.VerifyNone(t, ignore)
	})

	t.Run("Restart keeps the data and the clients", func(t *testing.T) {
		ctx := testCtx(t)
		s, err := Start(t.TempDir(), Config{})
		if err != nil {
			t.Fatalf("Start: %v", err)
		}
		defer s.Close()
		c, err := s.Dial()
		if err != nil {
			t.Fatalf("Dial: %v", err)
		}
		if _, err := c.Put(ctx, "k", "v"); err != nil {
			t.Fatalf("Put: %v", err)
		}
		s.Restart()
		waitValue(t, ctx, c, "k", "v", "after Restart")
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
	})

	t.Run("returns an error and leaves nothing behind when it cannot start", func(t *testing.T) {
		ignore := goleak.IgnoreCurrent()
		file := filepath.Join(t.TempDir(), "file")
		if err := os.WriteFile(file, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if s, err := Start(filepath.Join(file, "dir"), Config{}); err == nil {
			s.Close()
			t.Error("Start under a regular file succeeded")
		}
		// etcd refuses an election timeout shorter than 5 heartbeats.
		if s, err := Start(t.TempDir(), Config{TickMs: 100, ElectionMs: 200}); err == nil {
			s.Close()
			t.Error("Start with ElectionMs < 5*TickMs succeeded")
		} else {
			t.Logf("Start with a bad Config: %v", err)
		}
		goleak.VerifyNone(t, ignore)
	})

	t.Run("panics where a test would fail", func(t *testing.T) {
		s, err := Start(t.TempDir(), Config{})
		if err != nil {
			t.Fatalf("Start: %v", err)
		}
		defer s.Close()
		ctx := testCtx(t)
		s.Stop()
		mustPanic(t, "coordtest: reading revision: server is stopped", func() { s.Revision(ctx) })
		mustPanic(t, "coordtest: reading revision: server is stopped", func() { s.Compact(ctx) })
		s.Restart()
		if rev := s.Revision(ctx); rev < 1 {
			t.Errorf("Revision after Restart = %d", rev)
		}
		s.Close()
		mustPanic(t, "coordtest: Server.Client called after the server was closed", func() { s.Client() })
		mustPanic(t, "coordtest: Server.Restart called after the server was closed", s.Restart)
	})
}

func TestServerCloseEarly(t *testing.T) {
	ctx := testCtx(t)
	s := NewServer(t)
	c := s.NewClient(t)
	if _, err := c.Put(ctx, "k", "v"); err != nil {
		t.Fatalf("Put: %v", err)
	}
	s.Close() // the cleanup closes it again, harmlessly
	if c.Ctx().Err() == nil {
		t.Error("NewClient client still open after Close")
	}
	if _, err := s.Dial(); err == nil {
		t.Error("Dial succeeded after Close")
	}
}
