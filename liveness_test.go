package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/go-coord/coord/coordtest"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"runtime"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

func TestRegisterHostLiveness(t *testing.T) {
	t.Run("writes the metadata under the lease at the default prefix", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h, err := RegisterHostLiveness(ctx, cli, meta("a"), LivenessOptions{TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Stop(ctx)
		if h.Key() != HostsPrefix+"a" {
			t.Fatalf("key %q", h.Key())
		}
		resp, err := cli.Get(ctx, h.Key())
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("get: %v %v", resp, err)
		}
		var got HostMetadata
		if err := json.Unmarshal(resp.Kvs[0].Value, &got); err != nil {
			t.Fatal(err)
		}
		if got.Hostname != "host-a" || got.Labels["zone"] != "a" {
			t.Fatalf("stored %+v", got)
		}
		if clientv3.LeaseID(resp.Kvs[0].Lease) != h.LeaseID() || h.LeaseID() == 0 {
			t.Fatalf("lease %x, want %x", resp.Kvs[0].Lease, h.LeaseID())
		}
	})
	t.Run("reports the granted TTL", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h, err := RegisterHostLiveness(ctx, cli, meta("a"), LivenessOptions{TTL: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Stop(ctx)
		if h.TTL() != 3*time.Second {
			t.Fatalf("TTL %v", h.TTL())
		}
	})
	t.Run("keeps the lease alive past its TTL", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h, err := RegisterHostLiveness(ctx, cli, meta("a"), LivenessOptions{TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Stop(ctx)
		// For three TTLs, the key must see no change at all.
		resp, err := cli.Get(ctx, h.Key())
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		for wr := range cli.Watch(wctx, h.Key(), clientv3.WithRev(resp.Header.Revision+1)) {
			t.Fatalf("key changed: %+v", wr.Events)
		}
	})
}

// waitKey waits until the key's state satisfies ok (nil kv: no key) and
// returns that state.
func waitKey(t *testing.T, cli *clientv3.Client, key string, ok func(kv *mvccpb.KeyValue) bool) *mvccpb.KeyValue {
	t.Helper()
	ctx := testCtx(t)
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var kv *mvccpb.KeyValue
	if len(resp.Kvs) > 0 {
		kv = resp.Kvs[0]
	}
	if ok(kv) {
		return kv
	}
	for wr := range cli.Watch(ctx, key, clientv3.WithRev(resp.Header.Revision+1)) {
		for _, ev := range wr.Events {
			kv = ev.Kv
			if ev.Type == mvccpb.DELETE {
				kv = nil
			}
			if ok(kv) {
				return kv
			}
		}
	}
	t.Fatalf("key %s: state not reached before the deadline (last %v)", key, kv)
	return nil
}

func gone(kv *mvccpb.KeyValue) bool { return kv == nil }

// heldBy returns a predicate: the key exists under a lease other than old.
func heldByOtherThan(old clientv3.LeaseID) func(kv *mvccpb.KeyValue) bool {
	return func(kv *mvccpb.KeyValue) bool {
		return kv != nil && kv.Lease != 0 && clientv3.LeaseID(kv.Lease) != old
	}
}

func decodeKV(t *testing.T, kv *mvccpb.KeyValue) HostMetadata {
	t.Helper()
	var m HostMetadata
	if err := json.Unmarshal(kv.Value, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func register(t *testing.T, cli *clientv3.Client, id string, opts LivenessOptions) *HostLiveness {
	t.Helper()
	if opts.TTL == 0 {
		opts.TTL = time.Second
	}
	h, err := RegisterHostLiveness(testCtx(t), cli, meta(id), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(context.Background()) })
	return h
}

func TestHostLivenessStop(t *testing.T) {
	t.Run("revokes the lease at once and closes Done with no error", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{TTL: 10 * time.Second})
		lease := h.LeaseID()
		if err := h.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		// With a 10s TTL, only the revoke can have removed the key by now.
		if n := keyCount(t, cli, h.Key()); n != 0 {
			t.Fatalf("%d keys left", n)
		}
		ttl, err := cli.TimeToLive(ctx, lease)
		if err != nil || ttl.TTL != -1 {
			t.Fatalf("lease still there: %v %v", ttl, err)
		}
		if !closedWithin(h.Done()) || h.Err() != nil {
			t.Fatalf("done/err after stop: %v", h.Err())
		}
	})
	t.Run("is idempotent and safe from several goroutines", func(t *testing.T) {
		_, cli := newEtcd(t)
		h := register(t, cli, "a", LivenessOptions{})
		errs := make(chan error, 3)
		for range 3 {
			go func() { errs <- h.Stop(testCtx(t)) }()
		}
		for range 3 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
	})
	t.Run("after the client is closed, ends the registration and returns nil", func(t *testing.T) {
		srv, _ := newEtcd(t)
		cli := srv.NewClient(t)
		h := register(t, cli, "a", LivenessOptions{})
		cli.Close()
		if !closedWithin(h.Done()) {
			t.Fatal("Done not closed after the client was closed")
		}
		if !errors.Is(h.Err(), ErrClientClosed) {
			t.Fatalf("Err %v, want ErrClientClosed", h.Err())
		}
		if err := h.Stop(testCtx(t)); err != nil {
			t.Fatalf("Stop: %v", err)
		}
	})
	t.Run("on an unreachable etcd returns an error bounded by ctx", func(t *testing.T) {
		srv, _ := newEtcd(t)
		p := srv.NewProxy(t)
		h := register(t, p.NewClient(t), "a", LivenessOptions{})
		p.Blackhole()
		defer p.Unblackhole()
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		defer cancel()
		err := h.Stop(ctx)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Stop: %v, want deadline exceeded", err)
		}
		if again := h.Stop(testCtx(t)); again != err {
			t.Fatalf("second Stop %v, want the first result %v", again, err)
		}
	})
}

func TestHostLivenessUpdate(t *testing.T) {
	t.Run("writes new metadata under the same lease", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{})
		m := meta("a")
		m.Version = "2.0"
		if err := h.Update(ctx, m); err != nil {
			t.Fatal(err)
		}
		resp, err := cli.Get(ctx, h.Key())
		if err != nil {
			t.Fatal(err)
		}
		if got := decodeKV(t, resp.Kvs[0]); got.Version != "2.0" {
			t.Fatalf("version %q", got.Version)
		}
		if clientv3.LeaseID(resp.Kvs[0].Lease) != h.LeaseID() {
			t.Fatal("lease changed")
		}
	})
	t.Run("refuses another HostUUID and writes nothing", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{})
		before := keyCount(t, cli, "/")
		if err := h.Update(ctx, meta("b")); !errors.Is(err, ErrInvalidHostUUID) {
			t.Fatalf("Update: %v", err)
		}
		if after := keyCount(t, cli, "/"); after != before {
			t.Fatalf("keys %d -> %d", before, after)
		}
	})
	t.Run("after Stop returns ErrClosed", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{})
		h.Stop(ctx)
		if err := h.Update(ctx, meta("a")); !errors.Is(err, ErrClosed) {
			t.Fatalf("Update: %v", err)
		}
	})
	t.Run("after a takeover returns ErrHostExists", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{})
		register(t, cli, "a", LivenessOptions{Takeover: true})
		if !closedWithin(h.Done()) {
			t.Fatal("not ended")
		}
		if err := h.Update(ctx, meta("a")); !errors.Is(err, ErrHostExists) {
			t.Fatalf("Update: %v", err)
		}
	})
	t.Run("metadata larger than etcd accepts is refused and not recorded", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{})
		m := meta("a")
		m.Labels["big"] = strings.Repeat("x", 2<<20)
		if err := h.Update(ctx, m); err == nil {
			t.Fatal("Update of 2 MiB succeeded")
		}
		// A heal (key deleted) writes the last accepted metadata.
		if _, err := cli.Delete(ctx, h.Key()); err != nil {
			t.Fatal(err)
		}
		kv := waitKey(t, cli, h.Key(), heldByOtherThan(0))
		if got := decodeKV(t, kv); got.Labels["big"] != "" {
			t.Fatal("refused metadata was written by the heal")
		}
	})
	t.Run("ctx ending while waiting for a write returns the ctx error", func(t *testing.T) {
		srv, _ := newEtcd(t)
		p := srv.NewProxy(t)
		h := register(t, p.NewClient(t), "a", LivenessOptions{})
		p.Blackhole()
		defer p.Unblackhole()
		ctx, cancel := context.WithCancel(testCtx(t))
		done := make(chan error)
		go func() { done <- h.Update(ctx, meta("a")) }()
		// Once the first holds the write slot (stuck on the cut-off
		// link), a second waits behind it until its own ctx ends.
		for len(h.writes) == 0 {
			runtime.Gosched()
		}
		ctx2, cancel2 := context.WithTimeout(testCtx(t), 50*time.Millisecond)
		defer cancel2()
		if err := h.Update(ctx2, meta("a")); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("second Update: %v", err)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("first Update: %v", err)
		}
	})
}

func TestHostLivenessHeals(t *testing.T) {
	t.Run("after its lease is revoked by another client", func(t *testing.T) {
		srv, cli := newEtcd(t)
		h := register(t, srv.NewClient(t), "a", LivenessOptions{})
		old := h.LeaseID()
		if _, err := cli.Revoke(testCtx(t), old); err != nil {
			t.Fatal(err)
		}
		kv := waitKey(t, cli, h.Key(), heldByOtherThan(old))
		eventually(t, func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
		if decodeKV(t, kv).Hostname != "host-a" {
			t.Fatal("metadata lost in the heal")
		}
	})
	t.Run("after its key is deleted, with the latest metadata, revoking the old lease", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, srv.NewClient(t), "a", LivenessOptions{})
		m := meta("a")
		m.Version = "3.1"
		if err := h.Update(ctx, m); err != nil {
			t.Fatal(err)
		}
		old := h.LeaseID()
		if _, err := cli.Delete(ctx, h.Key()); err != nil {
			t.Fatal(err)
		}
		kv := waitKey(t, cli, h.Key(), heldByOtherThan(old))
		if got := decodeKV(t, kv); got.Version != "3.1" {
			t.Fatalf("healed with version %q", got.Version)
		}
		ttl, err := cli.TimeToLive(ctx, old)
		if err != nil || ttl.TTL != -1 {
			t.Fatalf("old lease not revoked: %v %v", ttl, err)
		}
	})
	t.Run("after its key is overwritten without a lease", func(t *testing.T) {
		srv, cli := newEtcd(t)
		h := register(t, srv.NewClient(t), "a", LivenessOptions{})
		old := h.LeaseID()
		if _, err := cli.Put(testCtx(t), h.Key(), "garbage"); err != nil {
			t.Fatal(err)
		}
		kv := waitKey(t, cli, h.Key(), heldByOtherThan(old))
		if decodeKV(t, kv).HostUUID != "a" {
			t.Fatal("garbage left in place")
		}
	})
	t.Run("after etcd restarts with compacted history, keeping its lease", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		tap, log := newLogTap()
		h := register(t, srv.NewClient(t), "a", LivenessOptions{TTL: 2 * time.Second, Logger: log})
		lease := h.LeaseID()
		// Move the store past the host's watch and compact it away: the
		// watch, resumed after the restart, fails as compacted.
		for i := range 5 {
			if _, err := cli.Put(ctx, fmt.Sprintf("/other/%d", i), "x"); err != nil {
				t.Fatal(err)
			}
		}
		srv.Compact(ctx)
		srv.Restart()
		tap.wait(t, "coord: host key watch resumed", 1)
		// The lease survives a restart (etcd renews every lease when a
		// leader takes office): the registration stays under it, and a
		// later delete is still noticed by the resumed watch.
		if _, err := cli.Delete(ctx, h.Key()); err != nil {
			t.Fatal(err)
		}
		kv := waitKey(t, cli, h.Key(), heldByOtherThan(lease))
		eventually(t, func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
	})
}

func TestHostLivenessOwnership(t *testing.T) {
	t.Run("a second owner waits out the live holder and gets ErrHostExists", func(t *testing.T) {
		_, cli := newEtcd(t)
		first := register(t, cli, "a", LivenessOptions{})
		start := time.Now()
		_, err := RegisterHostLiveness(testCtx(t), cli, meta("a"), LivenessOptions{TTL: time.Second})
		if !errors.Is(err, ErrHostExists) {
			t.Fatalf("second register: %v", err)
		}
		// It waited at least the holder's remaining TTL (0 or 1 s) plus slack.
		if waited := time.Since(start); waited < expirySlack {
			t.Fatalf("gave up after %v", waited)
		}
		kv := waitKey(t, cli, first.Key(), func(kv *mvccpb.KeyValue) bool { return kv != nil })
		if clientv3.LeaseID(kv.Lease) != first.LeaseID() {
			t.Fatal("the second owner wrote the key")
		}
		if n := keyCount(t, cli, "/"); n != 1 {
			t.Fatalf("%d keys", n)
		}
	})
	t.Run("the wait is bounded by ctx", func(t *testing.T) {
		_, cli := newEtcd(t)
		register(t, cli, "a", LivenessOptions{TTL: 5 * time.Second})
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		defer cancel()
		_, err := RegisterHostLiveness(ctx, cli, meta("a"), LivenessOptions{TTL: time.Second})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("register: %v", err)
		}
	})
	t.Run("a crash-restart registers once the old lease expires", func(t *testing.T) {
		srv, cli := newEtcd(t)
		crashed := srv.NewClient(t)
		old := register(t, crashed, "a", LivenessOptions{})
		oldLease := old.LeaseID()
		crashed.Close() // the process dies: no Stop, no revoke
		h, err := RegisterHostLiveness(testCtx(t), cli, meta("a"), LivenessOptions{TTL: time.Second})
		if err != nil {
			t.Fatalf("restart: %v", err)
		}
		defer h.Stop(testCtx(t))
		if h.LeaseID() == oldLease {
			t.Fatal("same lease")
		}
	})
	t.Run("Takeover overwrites at once and the first owner ends without fighting", func(t *testing.T) {
		_, cli := newEtcd(t)
		first := register(t, cli, "a", LivenessOptions{TTL: 10 * time.Second})
		second := register(t, cli, "a", LivenessOptions{Takeover: true})
		if !closedWithin(first.Done()) {
			t.Fatal("first owner did not end")
		}
		if !errors.Is(first.Err(), ErrHostExists) {
			t.Fatalf("first Err %v", first.Err())
		}
		// Its Stop revokes its own lease, not the key.
		if err := first.Stop(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		kv := waitKey(t, cli, second.Key(), func(kv *mvccpb.KeyValue) bool { return kv != nil })
		if clientv3.LeaseID(kv.Lease) != second.LeaseID() {
			t.Fatal("key not held by the second owner")
		}
	})
	t.Run("a heal never overwrites a key held by another lease", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		p := srv.NewProxy(t)
		h := register(t, p.NewClient(t), "a", LivenessOptions{TTL: 5 * time.Second})
		// While the host is cut off, its key is deleted and written under
		// a foreign lease: once back, it sees the delete first, and its
		// heal finds the key held.
		p.Blackhole()
		g, err := cli.Grant(ctx, 300) // outlives the test, even emulated
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Delete(ctx, h.Key()); err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, h.Key(), `{"host_uuid":"a"}`, clientv3.WithLease(g.ID)); err != nil {
			t.Fatal(err)
		}
		p.Unblackhole()
		if !closedWithin(h.Done()) || !errors.Is(h.Err(), ErrHostExists) {
			t.Fatalf("Err %v", h.Err())
		}
		kv := waitKey(t, cli, h.Key(), func(kv *mvccpb.KeyValue) bool { return kv != nil })
		if clientv3.LeaseID(kv.Lease) != g.ID {
			t.Fatal("heal overwrote the foreign key")
		}
	})
}

func TestHostLivenessRefusesBadInput(t *testing.T) {
	srv, cli := newEtcd(t)
	bigMeta := meta("big")
	bigMeta.Labels["x"] = strings.Repeat("x", 2<<20)
	cases := []struct {
		name string
		cli  *clientv3.Client
		meta HostMetadata
		opts LivenessOptions
		want error
	}{
		{"nil client", nil, meta("a"), LivenessOptions{}, ErrNilClient},
		{"empty HostUUID", cli, meta(""), LivenessOptions{}, ErrInvalidHostUUID},
		{"HostUUID with a slash", cli, meta("a/b"), LivenessOptions{}, ErrInvalidHostUUID},
		{"prefix without a trailing slash", cli, meta("a"), LivenessOptions{Prefix: "/hosts"}, ErrInvalidKey},
		{"negative TTL", cli, meta("a"), LivenessOptions{TTL: -time.Second}, ErrInvalidTTL},
		{"sub-second TTL", cli, meta("a"), LivenessOptions{TTL: 1500 * time.Millisecond}, ErrInvalidTTL},
		{"metadata larger than etcd accepts", cli, bigMeta, LivenessOptions{}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h, err := RegisterHostLiveness(testCtx(t), c.cli, c.meta, c.opts)
			if err == nil || (c.want != nil && !errors.Is(err, c.want)) {
				t.Fatalf("got %v %v, want %v", h, err, c.want)
			}
			if !strings.HasPrefix(err.Error(), "coord: ") {
				t.Fatalf("error %q lacks the package prefix", err)
			}
			if n := keyCount(t, cli, ""); n != 0 {
				t.Fatalf("%d keys written", n)
			}
			leases, err := cli.Leases(testCtx(t))
			if err != nil || len(leases.Leases) != 0 {
				t.Fatalf("leases left: %v %v", leases, err)
			}
		})
	}
	t.Run("cancelled ctx", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := RegisterHostLiveness(ctx, cli, meta("a"), LivenessOptions{})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("got %v", err)
		}
	})
	_ = srv
}

func TestHostLivenessReportsGrantedTTL(t *testing.T) {
	// An etcd whose election timeout makes its minimum TTL 2 s.
	srv := coordtest.NewServerWith(t, coordtest.Config{TickMs: 100, ElectionMs: 1000})
	h := register(t, srv.Client(), "a", LivenessOptions{TTL: time.Second})
	if h.TTL() != 2*time.Second {
		t.Fatalf("TTL %v, want the granted 2s", h.TTL())
	}
}

func TestHostLivenessStopDuringHeal(t *testing.T) {
	t.Run("Stop ends a heal waiting behind an update", func(t *testing.T) {
		_, cli := newEtcd(t)
		tap, log := newLogTap()
		h := register(t, cli, "a", LivenessOptions{Logger: log})
		// Hold the write slot as an Update in flight does; the heal that
		// the delete starts must wait for it, and Stop must still end it.
		h.writes <- struct{}{}
		if _, err := cli.Delete(testCtx(t), h.Key()); err != nil {
			t.Fatal(err)
		}
		tap.wait(t, "coord: host registration lost, healing", 1)
		if err := h.Stop(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		<-h.writes
		if h.Err() != nil {
			t.Fatalf("Err %v after Stop", h.Err())
		}
		if n := keyCount(t, cli, h.Key()); n != 0 {
			t.Fatal("healed after Stop")
		}
	})
}
