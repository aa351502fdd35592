package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
)

func TestRegisterHostLiveness(t *testing.T) {
	t.Parallel()
	t.Run("writes the metadata under the lease at the default prefix", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{TTL: time.Second})
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
		h := register(t, cli, "a", LivenessOptions{TTL: 3 * time.Second})
		if h.TTL() != 3*time.Second {
			t.Fatalf("TTL %v", h.TTL())
		}
	})
	t.Run("keeps the lease alive past its TTL", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{TTL: time.Second})
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

// heldByOtherThan returns a predicate: the key exists under a lease other than old.
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
	// A lease of 1 s can expire before the put that uses it lands, on a
	// loaded emulated CPU: the registration fails, having written nothing
	// (the put was refused), and is tried again, as its caller would.
	for try := 1; errors.Is(err, rpctypes.ErrLeaseNotFound) && try < 3; try++ {
		t.Logf("register %s, try %d: %v", id, try, err)
		h, err = RegisterHostLiveness(testCtx(t), cli, meta(id), opts)
	}
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
		eventually(t, "LeaseID to be the key's lease", func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
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
	t.Run("after an attempt whose put landed unanswered, its lease's revoke failing: the next attempt writes over its own key", func(t *testing.T) {
		testHealOverOwnAttempt(t, false)
	})
	t.Run("the same, the key gone with that lease just before the next attempt writes over it: the attempt after writes it afresh", func(t *testing.T) {
		testHealOverOwnAttempt(t, true)
	})
	t.Run("the same, with an Update made before the next attempt: it waits for the heal to write it, the key on that lease ours", testUpdateAmidHeal)
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
		eventually(t, "LeaseID to be the key's lease", func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
	})
}

// lostPut is a fault for a registration's heal: once armed, its first
// put of key lands but etcd's answer is lost ("request timed out"), and
// the first revoke of that put's lease is refused ("too many requests":
// etcd behind on its applying), so the lease lives on with the key.
// Other requests go through next.
type lostPut struct {
	key     string
	mu      sync.Mutex
	armed   bool
	lease   clientv3.LeaseID // the lease of the put whose answer is lost
	refused chan struct{}    // closed once its revoke is refused
}

func (f *lostPut) intercept(next grpc.UnaryClientInterceptor) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		f.mu.Lock()
		switch r := req.(type) {
		case *pb.TxnRequest:
			if put := putOf(r, f.key); f.armed && f.lease == 0 && put != nil {
				f.lease = clientv3.LeaseID(put.Lease)
				f.mu.Unlock()
				if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
					return err
				}
				return rpctypes.ErrGRPCTimeout // the put landed
			}
		case *pb.LeaseRevokeRequest:
			if f.lease != 0 && clientv3.LeaseID(r.ID) == f.lease && !isClosed(f.refused) {
				close(f.refused)
				f.mu.Unlock()
				return rpctypes.ErrGRPCRequestTooManyRequests
			}
		}
		f.mu.Unlock()
		return next(ctx, method, req, reply, cc, invoker, opts...)
	}
}

// lost returns the lease of the put whose answer is lost, 0 before it.
func (f *lostPut) lost() clientv3.LeaseID {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lease
}

// newLostPut returns the fault lostPut on host "a"'s key.
func newLostPut() *lostPut {
	return &lostPut{key: HostsPrefix + "a", refused: make(chan struct{})}
}

// heal registers host "a" (TTL 2 s: the lease of the lost put outlives
// the next attempt) on a client of srv with the fault f, then next; arms
// f, and revokes the registration's lease with cli: the heal's first
// attempt meets f. It returns the registration and its first lease.
func (f *lostPut) heal(t *testing.T, srv *coordtest.Server, cli *clientv3.Client, next grpc.UnaryClientInterceptor) (*HostLiveness, clientv3.LeaseID) {
	t.Helper()
	h := register(t, interceptedClient(t, srv.ClientConfig(), f.intercept(next)), "a", LivenessOptions{TTL: 2 * time.Second * scale})
	f.mu.Lock()
	f.armed = true
	f.mu.Unlock()
	old := h.LeaseID()
	if _, err := cli.Revoke(testCtx(t), old); err != nil {
		t.Fatal(err)
	}
	return h, old
}

// testHealOverOwnAttempt: a heal's attempt meets lostPut, so the lease of
// its put holds the key when the next attempt comes. That attempt must
// know the lease for one of its own, not another host's, and write over
// the key. With vanish, the lease goes (revoked from outside) just before
// that write, which then finds no key, and the attempt after writes it as
// free.
func testHealOverOwnAttempt(t *testing.T, vanish bool) {
	srv, cli := newEtcd(t)
	key := HostsPrefix + "a"
	var over atomic.Int32 // Txns that write over the key on the lost put's lease
	f := newLostPut()
	writesOver := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if r, ok := req.(*pb.TxnRequest); ok && putOf(r, key) != nil {
			if lost := f.lost(); lost != 0 && len(r.Compare) == 1 && r.Compare[0].GetLease() == int64(lost) {
				over.Add(1)
				if vanish {
					if _, err := cli.Revoke(ctx, lost); err != nil {
						return err
					}
				}
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	h, old := f.heal(t, srv, cli, writesOver)
	start := time.Now()
	// Healed on a third lease, neither the first nor the lost put's.
	var kv *mvccpb.KeyValue
	eventually(t, "the key held by a third lease, or the registration ended", func() bool {
		select {
		case <-h.Done():
			return true
		default:
		}
		g, err := cli.Get(testCtx(t), key)
		if err != nil || len(g.Kvs) == 0 {
			return false
		}
		kv = g.Kvs[0]
		l := clientv3.LeaseID(kv.Lease)
		return f.lost() != 0 && l != 0 && l != old && l != f.lost()
	})
	select {
	case <-h.Done():
		t.Fatalf("the registration ended: %v", h.Err())
	default:
	}
	eventually(t, "LeaseID to be the key's lease", func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
	t.Logf("healed %v after the revoke, past an attempt of its own on the key", time.Since(start).Round(time.Millisecond))
	if n := over.Load(); n != 1 {
		t.Fatalf("%d writes over the key on the lost put's lease, want 1", n)
	}
	// The lost put's lease gone at last: the key is not on it.
	eventually(t, "the lost put's lease gone", func() bool {
		ttl, err := cli.TimeToLive(testCtx(t), f.lost())
		return err == nil && ttl.TTL == -1
	})
	g, err := cli.Get(testCtx(t), key)
	if err != nil || len(g.Kvs) == 0 || g.Kvs[0].Lease != kv.Lease {
		t.Fatalf("once the lost put's lease is gone: %v %v, want the key on lease %x", g, err, kv.Lease)
	}
	if err := h.Healthy(); err != nil {
		t.Fatal(err)
	}
}

// testUpdateAmidHeal: a heal's attempt meets lostPut. An Update made
// before the next attempt finds the key on the lost put's lease: one of
// ours, so a heal is under way, and the Update waits for it to write the
// new metadata, instead of taking the key for another host's.
func testUpdateAmidHeal(t *testing.T) {
	srv, cli := newEtcd(t)
	key := HostsPrefix + "a"
	updated := make(chan struct{}) // the Update's write, answered
	var once sync.Once
	f := newLostPut()
	holdAttempt := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		switch r := req.(type) {
		case *pb.TxnRequest:
			err := invoker(ctx, method, req, reply, cc, opts...)
			if put := putOf(r, key); put != nil && strings.Contains(string(put.Value), `"version":"2.0"`) {
				once.Do(func() { close(updated) })
			}
			return err
		case *pb.LeaseGrantRequest:
			if isClosed(f.refused) {
				// The next attempt: after the Update's write.
				select {
				case <-updated:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	h, old := f.heal(t, srv, cli, holdAttempt)
	waitClosed(t, f.refused, "the refused revoke of the lost put's lease")
	m := meta("a")
	m.Version = "2.0"
	if err := h.Update(testCtx(t), m); err != nil {
		t.Fatalf("Update amid the heal: %v", err)
	}
	g, err := cli.Get(testCtx(t), key)
	if err != nil || len(g.Kvs) == 0 {
		t.Fatalf("get %s: %v %v", key, g, err)
	}
	kv := g.Kvs[0]
	if l := clientv3.LeaseID(kv.Lease); l == old || l == f.lost() || l != h.LeaseID() || decodeKV(t, kv).Version != "2.0" {
		t.Fatalf("after the Update: %s on lease %x (LeaseID %x, first %x, lost put's %x), want version 2.0 on the heal's lease", kv.Value, kv.Lease, h.LeaseID(), old, f.lost())
	}
}

// putOf returns the put of key that a Txn makes when it succeeds, or nil.
func putOf(txn *pb.TxnRequest, key string) *pb.PutRequest {
	for _, op := range txn.Success {
		if p := op.GetRequestPut(); p != nil && string(p.Key) == key {
			return p
		}
	}
	return nil
}

func TestHostLivenessOwnership(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
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
		ctx, cancel := context.WithCancel(testCtx(t))
		defer cancel()
		tap, log := newLogTap()
		res := make(chan error, 1)
		go func() {
			_, err := RegisterHostLiveness(ctx, cli, meta("a"), LivenessOptions{TTL: time.Second, Logger: log})
			res <- err
		}()
		// Cancelled once it waits, not before: the wait is what ends.
		tap.wait(t, "coord: host key held by another lease, waiting it out", 1)
		cancel()
		err := receive(t, res, "register")
		if !errors.Is(err, context.Canceled) || !strings.Contains(fmt.Sprint(err), "wait out lease") {
			t.Fatalf("register: %v, want the wait out ended by context canceled", err)
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

// hook is a slog.Handler that calls f, in the goroutine that logs, the
// first time msg is logged, then hands every record on to next: a test
// acts at that point of the registration's work, or holds it there.
type hook struct {
	next slog.Handler
	msg  string
	once *sync.Once
	f    func()
}

// withHook returns next, calling f the first time msg is logged.
func withHook(next *slog.Logger, msg string, f func()) *slog.Logger {
	return slog.New(&hook{next: next.Handler(), msg: msg, once: new(sync.Once), f: f})
}

// holdAt returns next, holding the goroutine that first logs msg until
// release is called; reached is closed once it is held.
func holdAt(next *slog.Logger, msg string) (log *slog.Logger, reached <-chan struct{}, release func()) {
	at, released := make(chan struct{}), make(chan struct{})
	log = withHook(next, msg, func() {
		close(at)
		<-released
	})
	return log, at, sync.OnceFunc(func() { close(released) })
}

func (k *hook) Enabled(context.Context, slog.Level) bool { return true }

func (k *hook) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == k.msg {
		k.once.Do(k.f)
	}
	return k.next.Handle(ctx, r)
}

func (k *hook) WithAttrs(as []slog.Attr) slog.Handler {
	c := *k
	c.next = k.next.WithAttrs(as)
	return &c
}

func (k *hook) WithGroup(name string) slog.Handler {
	c := *k
	c.next = k.next.WithGroup(name)
	return &c
}

// healOnce deletes h's key and returns the key as the heal wrote it.
func healOnce(t *testing.T, cli *clientv3.Client, h *HostLiveness) *mvccpb.KeyValue {
	t.Helper()
	old := h.LeaseID()
	if _, err := cli.Delete(testCtx(t), h.Key()); err != nil {
		t.Fatal(err)
	}
	kv := waitKey(t, cli, h.Key(), heldByOtherThan(old))
	eventually(t, "LeaseID to be the key's lease", func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
	return kv
}

// heldHeal registers host a on a client of its own, deletes its key
// through cli and returns once the heal that follows is held, before it
// writes; release lets it go on (the test's end does at the latest), and
// tap keeps every record the registration logs.
func heldHeal(t *testing.T) (cli *clientv3.Client, h *HostLiveness, tap *logTap, release func()) {
	t.Helper()
	srv, cli := newEtcd(t)
	tap, tlog := newLogTap()
	log, reached, release := holdAt(tlog, "coord: host registration lost, healing")
	h = register(t, srv.NewClient(t), "a", LivenessOptions{Logger: log})
	t.Cleanup(release) // before the registration's Stop, which waits for the heal
	if _, err := cli.Delete(testCtx(t), h.Key()); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, reached, "heal")
	return cli, h, tap, release
}

// editing changes labels, as a caller reusing its map does, until the
// returned function is called.
func editing(labels map[string]string) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-quit:
				return
			default:
			}
			labels["zone"] = strconv.Itoa(i)
			labels[strconv.Itoa(i%8)] = "edited"
			runtime.Gosched()
		}
	}()
	return func() {
		close(quit)
		<-done
	}
}

func TestHostLivenessCopiesMetadata(t *testing.T) {
	t.Run("a caller editing its Labels after the call changes nothing the heals write", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		m := meta("a")
		h, err := RegisterHostLiveness(ctx, srv.NewClient(t), m, LivenessOptions{TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Stop(ctx)
		stop := editing(m.Labels)
		got := decodeKV(t, healOnce(t, cli, h))
		stop()
		if len(got.Labels) != 1 || got.Labels["zone"] != "a" {
			t.Fatalf("healed with labels %v, want those passed to RegisterHostLiveness", got.Labels)
		}
		u := meta("a")
		u.Version = "2.0"
		u.Labels["zone"] = "b"
		if err := h.Update(ctx, u); err != nil {
			t.Fatal(err)
		}
		stop = editing(u.Labels)
		got = decodeKV(t, healOnce(t, cli, h))
		stop()
		if got.Version != "2.0" || len(got.Labels) != 1 || got.Labels["zone"] != "b" {
			t.Fatalf("healed with %+v, want what was passed to Update", got)
		}
	})
}

func TestHostLivenessStopWithinCtx(t *testing.T) {
	t.Parallel()
	t.Run("while a heal is stuck revoking on an unreachable etcd, the cleanup going on after", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		// The heal starts as the link is cut: its revoke of the old
		// lease gets no answer.
		tap, log := newLogTap()
		log = withHook(log, "coord: host registration lost, healing", p.Blackhole)
		ttl := 2 * time.Second
		h := register(t, p.NewClient(t), "a", LivenessOptions{TTL: ttl, Logger: log})
		defer p.Unblackhole()
		if _, err := cli.Delete(testCtx(t), h.Key()); err != nil {
			t.Fatal(err)
		}
		tap.wait(t, "coord: host registration lost, healing", 1)
		budget := 500 * time.Millisecond
		ctx, cancel := context.WithTimeout(context.Background(), budget)
		defer cancel()
		start := time.Now()
		err := h.Stop(ctx)
		if took := time.Since(start); took > budget+100*time.Millisecond*scale {
			t.Fatalf("Stop took %v with a ctx of %v (err %v)", took, budget, err)
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Stop: %v, want deadline exceeded", err)
		}
		// What is left of the cleanup is bounded by the TTL, and Done
		// closes once it is over.
		select {
		case <-h.Done():
		case <-time.After(ttl + patience()):
			t.Fatal("Done not closed after the cleanup")
		}
		if h.Err() != nil {
			t.Fatalf("Err %v after Stop", h.Err())
		}
	})
}

func TestHostLivenessWaitOut(t *testing.T) {
	t.Parallel()
	// holder writes the key under a lease of its own that nobody renews,
	// as a crashed host leaves it.
	holder := func(t *testing.T, cli *clientv3.Client, ttl time.Duration) clientv3.LeaseID {
		t.Helper()
		ctx := testCtx(t)
		g, err := cli.Grant(ctx, int64(ttl/time.Second))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, HostsPrefix+"a", `{"host_uuid":"a"}`, clientv3.WithLease(g.ID)); err != nil {
			t.Fatal(err)
		}
		return g.ID
	}
	// waiting starts a registration of "a" through p and returns its
	// result, once it waits for the holder's lease.
	waiting := func(t *testing.T, p *coordtest.Proxy) <-chan error {
		t.Helper()
		c := p.NewClient(t)
		tap, log := newLogTap()
		res := make(chan error, 1)
		go func() {
			h, err := RegisterHostLiveness(testCtx(t), c, meta("a"), LivenessOptions{TTL: time.Second, Logger: log})
			if err == nil {
				err = h.Stop(context.Background())
			}
			res <- err
		}()
		tap.wait(t, "coord: host key held by another lease, waiting it out", 1)
		return res
	}
	t.Run("a watch broken by a compaction waits on until the holder's lease expires", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		lease := holder(t, cli, 3*time.Second)
		res := waiting(t, p)
		// The waiter's watch resumes from a compacted revision.
		p.Blackhole()
		for i := range 5 {
			if _, err := cli.Put(testCtx(t), fmt.Sprintf("/other/%d", i), "x"); err != nil {
				t.Fatal(err)
			}
		}
		srv.Compact(testCtx(t))
		p.Unblackhole()
		if err := <-res; err != nil {
			t.Fatalf("register: %v", err)
		}
		if ttl, err := cli.TimeToLive(testCtx(t), lease); err != nil || ttl.TTL != -1 {
			t.Fatalf("registered while the holder's lease lived: %v %v", ttl, err)
		}
	})
	t.Run("a delete lost to a compaction is seen by reading the key again", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		lease := holder(t, cli, 300*time.Second) // outlives the test
		res := waiting(t, p)
		p.Blackhole()
		if _, err := cli.Revoke(testCtx(t), lease); err != nil {
			t.Fatal(err)
		}
		// Compacted past the delete: the resumed watch cannot see it.
		if _, err := cli.Put(testCtx(t), "/other", "x"); err != nil {
			t.Fatal(err)
		}
		srv.Compact(testCtx(t))
		p.Unblackhole()
		if err := <-res; err != nil {
			t.Fatalf("register: %v", err)
		}
	})
}

func TestHostLivenessUpdateWrites(t *testing.T) {
	t.Run("when the key was taken over, fails with ErrHostExists and writes nothing", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		// The registration is held as it ends, before Done closes.
		log, reached, release := holdAt(discard, "coord: host registration ended")
		defer release()
		h := register(t, cli, "a", LivenessOptions{TTL: 5 * time.Second, Logger: log})
		g, err := cli.Grant(ctx, 300) // outlives the test
		if err != nil {
			t.Fatal(err)
		}
		other := `{"host_uuid":"a","version":"other"}`
		if _, err := cli.Put(ctx, h.Key(), other, clientv3.WithLease(g.ID)); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, reached, "end of the registration")
		m := meta("a")
		m.Version = "2.0"
		if err := h.Update(ctx, m); !errors.Is(err, ErrHostExists) {
			t.Fatalf("Update: %v, want ErrHostExists", err)
		}
		resp, err := cli.Get(ctx, h.Key())
		if err != nil {
			t.Fatal(err)
		}
		if kv := resp.Kvs[0]; clientv3.LeaseID(kv.Lease) != g.ID || string(kv.Value) != other {
			t.Fatalf("key %s under lease %x, want the other writer's", kv.Value, kv.Lease)
		}
	})
	t.Run("when the key was deleted, returns nil only once the heal wrote it", func(t *testing.T) {
		cli, h, tap, release := heldHeal(t)
		ctx := testCtx(t)
		// With the heal held up, etcd cannot hold the update.
		m := meta("a")
		m.Version = "2.0"
		short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		if err := h.Update(short, m); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Update with the heal held up: %v, want deadline exceeded", err)
		}
		m.Version = "3.0"
		updated := make(chan error, 1)
		go func() { updated <- h.Update(ctx, m) }()
		// The heal goes on once this Update waits for it.
		tap.wait(t, "coord: host key not ours, waiting for the heal to write the update", 2)
		release()
		if err := receive(t, updated, "Update"); err != nil {
			t.Fatalf("Update: %v", err)
		}
		resp, err := cli.Get(ctx, h.Key())
		if err != nil || len(resp.Kvs) == 0 {
			t.Fatalf("key gone after Update returned: %v", err)
		}
		if got := decodeKV(t, resp.Kvs[0]); got.Version != "3.0" || clientv3.LeaseID(resp.Kvs[0].Lease) != h.LeaseID() {
			t.Fatalf("etcd holds version %q under lease %x after Update returned", got.Version, resp.Kvs[0].Lease)
		}
	})
	t.Run("waiting for a heal, fails with ErrClosed once stopped", func(t *testing.T) {
		_, h, tap, release := heldHeal(t)
		ctx := testCtx(t)
		updated := make(chan error, 1)
		go func() { updated <- h.Update(ctx, meta("a")) }()
		tap.wait(t, "coord: host key not ours, waiting for the heal to write the update", 1)
		stopped := make(chan error, 1)
		go func() { stopped <- h.Stop(ctx) }()
		if err := receive(t, updated, "Update"); !errors.Is(err, ErrClosed) {
			t.Fatalf("Update: %v, want ErrClosed", err)
		}
		release()
		if err := receive(t, stopped, "Stop"); err != nil {
			t.Fatalf("Stop: %v", err)
		}
	})
	t.Run("when etcd cannot be reached, fails within ctx and the next heal writes it", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		h := register(t, p.NewClient(t), "a", LivenessOptions{TTL: 5 * time.Second})
		p.Blackhole()
		m := meta("a")
		m.Version = "2.0"
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		defer cancel()
		if err := h.Update(ctx, m); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Update: %v, want deadline exceeded", err)
		}
		p.Unblackhole()
		if got := decodeKV(t, healOnce(t, cli, h)); got.Version != "2.0" {
			t.Fatalf("healed with version %q, want the update's", got.Version)
		}
	})
}

func TestHostLivenessErrorsSayCoordOnce(t *testing.T) {
	srv, _ := newEtcd(t)
	p := srv.NewProxy(t)
	c := p.NewClient(t)
	h := register(t, c, "a", LivenessOptions{TTL: 5 * time.Second})
	p.Blackhole()
	defer p.Unblackhole()
	short := func(t *testing.T) context.Context {
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	once := func(t *testing.T, err error) {
		t.Helper()
		if !errors.Is(err, context.DeadlineExceeded) || strings.Count(fmt.Sprint(err), "coord:") != 1 {
			t.Fatalf("error %q: want deadline exceeded, saying \"coord:\" once", err)
		}
	}
	t.Run("a registration on an unreachable etcd", func(t *testing.T) {
		_, err := RegisterHostLiveness(short(t), c, meta("b"), LivenessOptions{})
		once(t, err)
	})
	t.Run("an update on an unreachable etcd", func(t *testing.T) {
		once(t, h.Update(short(t), meta("a")))
	})
	t.Run("a stop on an unreachable etcd", func(t *testing.T) {
		once(t, h.Stop(short(t)))
	})
}

func TestHostLivenessEtcdReplaced(t *testing.T) {
	t.Run("heals on an etcd reset, its revisions started over, and says etcd was replaced", func(t *testing.T) {
		srv, cli := newEtcd(t)
		s := &signals{}
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		h := register(t, cli, "a", LivenessOptions{Logger: log, OnSignal: s.hook})
		for range 300 {
			wtPut(t, cli, "/elsewhere/", meta("x"), 0)
		}
		// A write: its answer says how far etcd's revisions went.
		if err := h.Update(testCtx(t), meta("a")); err != nil {
			t.Fatal(err)
		}
		old := h.LeaseID()
		srv.Reset()
		got := s.waitFor(t, SignalEtcdReplaced, 1)
		if got.Key != h.Key() || got.Host != "a" || !errors.Is(got.Err, errEtcdReplaced) {
			t.Fatalf("signal %+v, want one of a's registration saying etcd was replaced", got)
		}
		t.Logf("signal: %v", got.Err)
		// Said by the write that registered it on the new etcd.
		eventually(t, "a registered on the new etcd", func() bool {
			resp, err := cli.Get(testCtx(t), h.Key())
			return err == nil && len(resp.Kvs) == 1 && h.LeaseID() != old && clientv3.LeaseID(resp.Kvs[0].Lease) == h.LeaseID()
		})
	})
}
