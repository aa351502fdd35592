package coord

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
)

// etKey is the election key of the tests: each test has an etcd of its own.
const etKey = "/coord/test/election"

// etPrefix is where the candidates of etKey live.
const etPrefix = etKey + "/"

// etElection joins the election opts.Key (default etKey, TTL 2s) on cli and
// closes it at the end of the test.
func etElection(t *testing.T, cli *clientv3.Client, opts ElectionOptions) *Election {
	t.Helper()
	if opts.Key == "" {
		opts.Key = etKey
	}
	if opts.TTL == 0 {
		opts.TTL = 2 * time.Second
	}
	e, err := NewElection(testCtx(t), cli, opts)
	if err != nil {
		t.Fatalf("NewElection: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// etCampaign makes e lead as id, failing the test otherwise.
func etCampaign(t *testing.T, e *Election, id string) {
	t.Helper()
	if err := e.Campaign(testCtx(t), id); err != nil {
		t.Fatalf("Campaign(%q): %v", id, err)
	}
	if !e.IsLeader() {
		t.Fatalf("Campaign(%q) returned nil but IsLeader is false", id)
	}
}

// etResult is the outcome of a Campaign run in the background.
type etResult struct {
	err error
	at  time.Time // when Campaign returned
}

// etCampaignAsync runs e.Campaign(ctx, id) in the background. The election's
// Close (at the latest at the end of the test) ends it.
func etCampaignAsync(ctx context.Context, e *Election, id string) <-chan etResult {
	ch := make(chan etResult, 1)
	go func() {
		err := e.Campaign(ctx, id)
		ch <- etResult{err, time.Now()}
	}()
	return ch
}

// etWait returns the outcome of a background Campaign, failing the test if
// it does not return within patience.
func etWait(t *testing.T, ch <-chan etResult) etResult {
	t.Helper()
	return receive(t, ch, "Campaign")
}

// etWaitCount waits, watching, until n keys match key with opts (e.g.
// clientv3.WithPrefix()), failing the test after patience.
func etWaitCount(t *testing.T, cli *clientv3.Client, key string, n int64, opts ...clientv3.OpOption) {
	t.Helper()
	ctx := testCtx(t)
	for {
		resp, err := cli.Get(ctx, key, append([]clientv3.OpOption{clientv3.WithCountOnly()}, opts...)...)
		if err != nil {
			t.Fatalf("count %q: %v", key, err)
		}
		if resp.Count == n {
			return
		}
		wctx, cancel := context.WithCancel(ctx)
		<-cli.Watch(wctx, key, append([]clientv3.OpOption{clientv3.WithRev(resp.Header.Revision + 1)}, opts...)...)
		cancel()
		if ctx.Err() != nil {
			t.Fatalf("%d keys at %q, want %d", resp.Count, key, n)
		}
	}
}

// etRivals starts two elections of etKey, on two clients of one etcd,
// and makes a the leader.
func etRivals(t *testing.T) (srv *coordtest.Server, cli *clientv3.Client, a, b *Election) {
	t.Helper()
	srv, cli = newEtcd(t)
	a = etElection(t, cli, ElectionOptions{})
	b = etElection(t, srv.NewClient(t), ElectionOptions{})
	etCampaign(t, a, "a")
	return srv, cli, a, b
}

// etQueue starts b's Campaign in ctx and waits until its candidate key is
// in line behind the leader's.
func etQueue(t *testing.T, ctx context.Context, cli *clientv3.Client, b *Election) <-chan etResult {
	t.Helper()
	res := etCampaignAsync(ctx, b, "b")
	etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
	return res
}

// etHandOver has the leader a resign and checks that the Campaign of b
// waiting in res then returns nil, with b leading.
func etHandOver(t *testing.T, a, b *Election, res <-chan etResult) {
	t.Helper()
	if err := a.Resign(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if r := etWait(t, res); r.err != nil || !b.IsLeader() {
		t.Fatalf("Campaign waiting behind the leader: %v, IsLeader %v", r.err, b.IsLeader())
	}
}

// etWantCands fails the test unless etKey has n candidates.
func etWantCands(t *testing.T, cli *clientv3.Client, n int) {
	t.Helper()
	if got := len(candidates(t, cli, etPrefix)); got != n {
		t.Fatalf("%d candidates, want %d", got, n)
	}
}

// etLeadUnheard makes an election lead as "a" on a client that, when it
// next sends a Txn, first has another client delete the leader key: e
// acts on a deletion it has not heard of yet. It returns the other client.
func etLeadUnheard(t *testing.T) (cli *clientv3.Client, e *Election) {
	t.Helper()
	srv, cli := newEtcd(t)
	hcli, hooks := etHookedClient(t, srv.ClientConfig())
	e = etElection(t, hcli, ElectionOptions{})
	etCampaign(t, e, "a")
	key := e.current().key
	hooks.on("/etcdserverpb.KV/Txn", func() {
		if _, err := cli.Delete(context.Background(), key); err != nil {
			t.Error(err)
		}
	})
	return cli, e
}

// etTTL returns the remaining TTL of lease id in seconds, -1 once it is gone.
func etTTL(t *testing.T, cli *clientv3.Client, id clientv3.LeaseID) int64 {
	t.Helper()
	resp, err := cli.TimeToLive(testCtx(t), id)
	if err != nil {
		t.Fatalf("TimeToLive(%x): %v", int64(id), err)
	}
	return resp.TTL
}

// etRevoke revokes lease id through cli, as another agent would.
func etRevoke(t *testing.T, cli *clientv3.Client, id clientv3.LeaseID) {
	t.Helper()
	if _, err := cli.Revoke(testCtx(t), id); err != nil {
		t.Fatalf("revoke %x: %v", int64(id), err)
	}
}

// etSession returns e's current session.
func etSession(e *Election) *session {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.sess
}

// etOpen fails the test if c is closed.
func etOpen(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
		t.Fatalf("%s is closed", what)
	default:
	}
}

// etNext returns the next identity sent on an Observe channel.
func etNext(t *testing.T, ch <-chan string) string {
	t.Helper()
	select {
	case id, ok := <-ch:
		if !ok {
			t.Fatal("Observe channel closed")
		}
		return id
	case <-time.After(patience()):
		t.Fatal("nothing observed before the deadline")
	}
	return ""
}

// etExpect checks that the next identity sent on ch is want.
func etExpect(t *testing.T, ch <-chan string, want string) {
	t.Helper()
	if got := etNext(t, ch); got != want {
		t.Fatalf("observed %q, want %q", got, want)
	}
}

// etDrained waits until ch is closed, failing the test after patience.
func etDrained(t *testing.T, ch <-chan string) {
	t.Helper()
	deadline := time.After(patience())
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatal("Observe channel not closed before the deadline")
		}
	}
}

// etGuarded runs a Txn under cmp and reports whether it succeeded.
func etGuarded(t *testing.T, cli *clientv3.Client, cmp clientv3.Cmp) bool {
	t.Helper()
	resp, err := cli.Txn(testCtx(t)).If(cmp).Then(clientv3.OpPut("/coord/test/fenced", "work")).Commit()
	if err != nil {
		t.Fatalf("guarded txn: %v", err)
	}
	return resp.Succeeded
}

// etHooks runs a function when a client sends a given gRPC request, so
// that a test can act at that very moment; a hook may also fail the
// request before it is sent (as a member without leader answers at once),
// or lose the answer of one that etcd carried out.
type etHooks struct {
	mu    sync.Mutex
	hooks map[string]func() error // by full method name; each runs once
	lost  map[string]bool         // methods whose next answer is lost
	after map[string]func()       // run once a method is answered; each runs once
	held  *etHold                 // the next live delete waits for it
}

// etHold holds a request until release is closed.
type etHold struct{ release <-chan struct{} }

// holdDelete makes the next transaction that deletes, sent with a live
// ctx, wait before it is sent until release is closed (or its ctx ends).
// Requests whose ctx has ended already pass, to fail as they would.
func (h *etHooks) holdDelete(release <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.held = &etHold{release: release}
}

func (h *etHooks) wait(ctx context.Context, req any) {
	txn, ok := req.(*pb.TxnRequest)
	if !ok || ctx.Err() != nil || !slices.ContainsFunc(txn.Success, func(op *pb.RequestOp) bool { return op.GetRequestDeleteRange() != nil }) {
		return
	}
	if held := h.take(); held != nil {
		select {
		case <-held.release:
		case <-ctx.Done():
		}
	}
}

// take returns the hold holdDelete set, if any, and clears it: a hold
// applies to one request.
func (h *etHooks) take() *etHold {
	h.mu.Lock()
	defer h.mu.Unlock()
	held := h.held
	h.held = nil
	return held
}

// on runs f the next time the client sends method (e.g. "/etcdserverpb.KV/Txn").
func (h *etHooks) on(method string, f func()) {
	h.onErr(method, func() error { f(); return nil })
}

// onErr runs f the next time the client sends method; if f returns an
// error, the request fails with it and is not sent.
func (h *etHooks) onErr(method string, f func() error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.hooks[method] = f
}

// loseAnswer makes the next request of method reach etcd, and its answer
// be lost on the way back: the caller gets an error.
func (h *etHooks) loseAnswer(method string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lost[method] = true
}

func (h *etHooks) fire(method string) error {
	h.mu.Lock()
	f := h.hooks[method]
	delete(h.hooks, method)
	h.mu.Unlock()
	if f != nil {
		return f()
	}
	return nil
}

// onAnswer runs f the next time etcd answers method, before the caller
// gets the answer.
func (h *etHooks) onAnswer(method string, f func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.after[method] = f
}

func (h *etHooks) answer(method string, err error) error {
	h.mu.Lock()
	f := h.after[method]
	delete(h.after, method)
	lose := err == nil && h.lost[method]
	delete(h.lost, method)
	h.mu.Unlock()
	if f != nil {
		f()
	}
	if lose {
		return errors.New("test: answer lost on the way back")
	}
	return err
}

// etHookedClient returns a client made from cfg whose requests run the hooks
// set on the returned etHooks first. It is closed at the end of the test.
func etHookedClient(t *testing.T, cfg clientv3.Config) (*clientv3.Client, *etHooks) {
	t.Helper()
	h := &etHooks{hooks: map[string]func() error{}, lost: map[string]bool{}, after: map[string]func(){}}
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any,
			cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if err := h.fire(method); err != nil {
				return err
			}
			h.wait(ctx, req)
			return h.answer(method, invoker(ctx, method, req, reply, cc, opts...))
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn,
			method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			if err := h.fire(method); err != nil {
				return nil, err
			}
			return streamer(ctx, desc, cc, method, opts...)
		}))
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, h
}

func TestElectionCampaign(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("Campaign makes us leader and Leader returns our identity", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		e := etElection(t, cli, ElectionOptions{})
		if e.IsLeader() || e.Token() != 0 {
			t.Fatalf("leads before campaigning: IsLeader %v, Token %d", e.IsLeader(), e.Token())
		}
		etCampaign(t, e, "a")
		if e.Token() <= 0 {
			t.Fatalf("Token %d, want > 0", e.Token())
		}
		etOpen(t, e.Done(), "Done while leading")
		if got, err := e.Leader(ctx); err != nil || got != "a" {
			t.Fatalf("Leader = %q, %v; want a", got, err)
		}
		if e.Key() != etKey {
			t.Fatalf("Key = %q, want %q", e.Key(), etKey)
		}
		// The wire format: <Key>/<lease hex>, on the session's lease,
		// created at the revision given as token.
		cands := candidates(t, cli, etPrefix)
		if len(cands) != 1 {
			t.Fatalf("%d candidates, want 1", len(cands))
		}
		kv := cands[0]
		if string(kv.Key) != etPrefix+hexID(clientv3.LeaseID(kv.Lease)) || kv.Lease == 0 {
			t.Fatalf("candidate key %q on lease %x", kv.Key, kv.Lease)
		}
		if clientv3.LeaseID(kv.Lease) != etSession(e).id {
			t.Fatalf("candidate on lease %x, session lease %x", kv.Lease, int64(etSession(e).id))
		}
		if kv.CreateRevision != e.Token() || string(kv.Value) != "a" {
			t.Fatalf("candidate created at %d with %q; token %d", kv.CreateRevision, kv.Value, e.Token())
		}
	})
	t.Run("Campaign with an empty identity proclaims ElectionOptions.Identity", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		e := etElection(t, cli, ElectionOptions{Identity: "from-options"})
		etCampaign(t, e, "")
		if got, err := e.Leader(ctx); err != nil || got != "from-options" {
			t.Fatalf("Leader = %q, %v; want from-options", got, err)
		}
	})
	t.Run("Campaign while leading returns nil and proclaims the new identity", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		e := etElection(t, cli, ElectionOptions{})
		etCampaign(t, e, "a")
		token, done := e.Token(), e.Done()
		etCampaign(t, e, "b")
		if got, err := e.Leader(ctx); err != nil || got != "b" {
			t.Fatalf("Leader = %q, %v; want b", got, err)
		}
		if e.Token() != token || e.Done() != done {
			t.Fatalf("a new term began: token %d, was %d", e.Token(), token)
		}
		etOpen(t, done, "Done while leading")
		etWantCands(t, cli, 1)
	})
	t.Run("Proclaim changes the identity while leading and fails with ErrNotLeader otherwise", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		e := etElection(t, cli, ElectionOptions{})
		other := etElection(t, srv.NewClient(t), ElectionOptions{})
		if err := e.Proclaim(ctx, "x"); !errors.Is(err, ErrNotLeader) {
			t.Fatalf("Proclaim before campaigning: %v, want ErrNotLeader", err)
		}
		etCampaign(t, e, "a")
		if err := e.Proclaim(ctx, "a2"); err != nil {
			t.Fatalf("Proclaim while leading: %v", err)
		}
		if got, err := other.Leader(ctx); err != nil || got != "a2" {
			t.Fatalf("Leader = %q, %v; want a2", got, err)
		}
		if err := other.Proclaim(ctx, "x"); !errors.Is(err, ErrNotLeader) {
			t.Fatalf("Proclaim by a non-leader: %v, want ErrNotLeader", err)
		}
		if err := e.Resign(ctx); err != nil {
			t.Fatal(err)
		}
		if err := e.Proclaim(ctx, "x"); !errors.Is(err, ErrNotLeader) {
			t.Fatalf("Proclaim after Resign: %v, want ErrNotLeader", err)
		}
		etWantCands(t, cli, 0)
	})
	t.Run("Proclaim racing a deletion it has not heard of yet returns ErrNotLeader", func(t *testing.T) {
		// Deleted after Proclaim checked that we lead, before its Txn.
		cli, e := etLeadUnheard(t)
		if err := e.Proclaim(testCtx(t), "b"); !errors.Is(err, ErrNotLeader) {
			t.Fatalf("Proclaim: %v, want ErrNotLeader", err)
		}
		waitClosed(t, e.Done(), "Done")
		etWantCands(t, cli, 0)
	})
	t.Run("Campaign while leading on a key deleted unheard of campaigns anew", func(t *testing.T) {
		_, e := etLeadUnheard(t)
		token, done := e.Token(), e.Done()
		etCampaign(t, e, "b")
		waitClosed(t, done, "Done of the first term")
		if e.Token() <= token || !e.IsLeader() {
			t.Fatalf("token %d (was %d), IsLeader %v", e.Token(), token, e.IsLeader())
		}
		if got, err := e.Leader(testCtx(t)); err != nil || got != "b" {
			t.Fatalf("Leader = %q, %v; want b", got, err)
		}
	})
	t.Run("Campaign while leading fails with the error etcd gives its Proclaim", func(t *testing.T) {
		srv, _ := newEtcd(t)
		hcli, hooks := etHookedClient(t, srv.ClientConfig())
		e := etElection(t, hcli, ElectionOptions{})
		etCampaign(t, e, "a")
		hooks.onErr("/etcdserverpb.KV/Txn", func() error { return rpctypes.ErrGRPCPermissionDenied })
		err := e.Campaign(testCtx(t), "b")
		if !errors.Is(err, rpctypes.ErrPermissionDenied) || errors.Is(err, ErrNotLeader) {
			t.Fatalf("Campaign: %v, want permission denied", err)
		}
	})
	t.Run("Leader returns ErrNoLeader when nobody leads and the ctx's error when it ended", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		if got, err := e.Leader(testCtx(t)); !errors.Is(err, ErrNoLeader) {
			t.Fatalf("Leader = %q, %v; want ErrNoLeader", got, err)
		}
		ctx, cancel := context.WithCancel(testCtx(t))
		cancel()
		if _, err := e.Leader(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("Leader with an ended ctx: %v, want context.Canceled", err)
		}
	})
	t.Run("Campaign leaves no key behind when its ctx is canceled while it waits", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		ctx, cancel := context.WithCancel(testCtx(t))
		res := etQueue(t, ctx, cli, b)
		bKey := string(candidates(t, cli, etPrefix)[1].Key)
		cancel()
		if r := etWait(t, res); !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Campaign: %v, want context.Canceled", r.err)
		}
		etWaitCount(t, cli, bKey, 0)
		if b.IsLeader() || !a.IsLeader() {
			t.Fatalf("IsLeader: a %v, b %v", a.IsLeader(), b.IsLeader())
		}
		etWantCands(t, cli, 1)
	})
	t.Run("A waiting Campaign cut off from etcd returns as its ctx ends; its key is withdrawn once etcd answers", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		a := etElection(t, cli, ElectionOptions{})
		b := etElection(t, p.NewClient(t), ElectionOptions{TTL: 10 * time.Second * scale})
		t.Cleanup(p.Unblackhole) // before the elections close
		etCampaign(t, a, "a")
		ctx, cancel := context.WithCancel(testCtx(t))
		defer cancel()
		res := etCampaignAsync(ctx, b, "b")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		p.Blackhole()
		ended := time.Now()
		cancel()
		r := etWait(t, res)
		if !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Campaign: %v, want Canceled", r.err)
		}
		if took := r.at.Sub(ended); took > 100*time.Millisecond*scale {
			t.Fatalf("Campaign returned %v after its ctx ended, want at once (its key is withdrawn in the background)", took)
		}
		p.Unblackhole()
		etWaitCount(t, cli, etPrefix, 1, clientv3.WithPrefix())
	})
	t.Run("A waiting Campaign whose session's lease is revoked queues again on a new session", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		res := etQueue(t, testCtx(t), cli, b)
		old := clientv3.LeaseID(candidates(t, cli, etPrefix)[1].Lease)
		etRevoke(t, cli, old)
		eventually(t, "queued again on a new lease", func() bool {
			c := candidates(t, cli, etPrefix)
			return len(c) == 2 && clientv3.LeaseID(c[1].Lease) != old
		})
		etHandOver(t, a, b, res)
		if got := clientv3.LeaseID(candidates(t, cli, etPrefix)[0].Lease); got == old {
			t.Fatal("leads on the revoked lease")
		}
	})
	t.Run("A waiting Campaign whose candidate key is deleted queues again", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		res := etQueue(t, testCtx(t), cli, b)
		first := candidates(t, cli, etPrefix)[1]
		if _, err := cli.Delete(testCtx(t), string(first.Key)); err != nil {
			t.Fatal(err)
		}
		eventually(t, "queued again", func() bool {
			c := candidates(t, cli, etPrefix)
			return len(c) == 2 && c[1].CreateRevision > first.CreateRevision
		})
		// The session was not harmed: b queued again on the same lease.
		if got := clientv3.LeaseID(candidates(t, cli, etPrefix)[1].Lease); got != clientv3.LeaseID(first.Lease) {
			t.Fatalf("b queued on lease %x, want %x", int64(got), first.Lease)
		}
		etHandOver(t, a, b, res)
	})
	t.Run("A waiting Campaign cut off from etcd waits through the outage and queues again", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		a := etElection(t, cli, ElectionOptions{})
		tap, log := newLogTap()
		b := etElection(t, p.NewClient(t), ElectionOptions{TTL: time.Second, Logger: log})
		etCampaign(t, a, "a")
		res := etCampaignAsync(testCtx(t), b, "b")
		// Cut off once b waits, not while its put is on the way.
		tap.wait(t, "coord: campaign waits for its turn", 1)
		old := etSession(b)
		bKey := string(candidates(t, cli, etPrefix)[1].Key)
		p.Blackhole()
		// etcd expires the lease, and the key with it.
		etWaitCount(t, cli, bKey, 0)
		select {
		case r := <-res:
			t.Fatalf("Campaign returned during the outage: %v", r.err)
		default:
		}
		p.Unblackhole()
		// etcd says the lease is gone: b queues again on a new one.
		waitClosed(t, old.ctx.Done(), "the cut-off session")
		eventually(t, "queued again", func() bool { return len(candidates(t, cli, etPrefix)) == 2 })
		etHandOver(t, a, b, res)
	})
	t.Run("Campaign after its lease expired unnoticed starts a new session", func(t *testing.T) {
		srv, cli := newEtcd(t)
		// A long TTL: the session renews (and would notice) only after
		// a third of it, long after this Campaign.
		e := etElection(t, srv.NewClient(t), ElectionOptions{TTL: 6 * time.Second})
		old := etSession(e)
		etRevoke(t, cli, old.id)
		etCampaign(t, e, "a")
		lease := clientv3.LeaseID(candidates(t, cli, etPrefix)[0].Lease)
		if lease == old.id || lease != etSession(e).id {
			t.Fatalf("leads on lease %x; old %x, session %x", int64(lease), int64(old.id), int64(etSession(e).id))
		}
		waitClosed(t, old.ctx.Done(), "the old session")
	})
	t.Run("Campaign with an identity too large for etcd fails and leaves no key", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		lease := etSession(e).id
		big := strings.Repeat("x", 1600<<10) // over etcd's 1.5 MiB request limit
		// Refused for good: it returns at once, not at its ctx.
		if err := e.Campaign(testCtx(t), big); err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Campaign with a huge identity: %v, want etcd's refusal", err)
		}
		if e.IsLeader() {
			t.Fatal("leads after a failed Campaign")
		}
		etWantCands(t, cli, 0)
		// Nothing was left to clean up: the session lives on.
		etCampaign(t, e, "a")
		if got := clientv3.LeaseID(candidates(t, cli, etPrefix)[0].Lease); got != lease {
			t.Fatalf("leads on lease %x, want the first session's %x", int64(got), int64(lease))
		}
		if err := e.Proclaim(testCtx(t), big); err == nil {
			t.Fatal("Proclaim with a huge identity succeeded")
		}
		if got, err := e.Leader(testCtx(t)); err != nil || got != "a" {
			t.Fatalf("Leader = %q, %v; want a", got, err)
		}
	})
	t.Run("Campaign takes over a candidate key left on its own lease", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		e := etElection(t, cli, ElectionOptions{})
		// A concurrency program sharing our lease campaigned and went away.
		cs, err := concurrency.NewSession(cli, concurrency.WithLease(etSession(e).id))
		if err != nil {
			t.Fatal(err)
		}
		ce := concurrency.NewElection(cs, etKey)
		if err := ce.Campaign(ctx, "old"); err != nil {
			t.Fatal(err)
		}
		cs.Orphan()
		etCampaign(t, e, "new")
		if e.Token() != ce.Rev() {
			t.Fatalf("Token %d, want the existing key's revision %d", e.Token(), ce.Rev())
		}
		if got, err := e.Leader(ctx); err != nil || got != "new" {
			t.Fatalf("Leader = %q, %v; want new", got, err)
		}
		etWantCands(t, cli, 1)
	})
	t.Run("TryCampaign, Proclaim and Resign do not wait for a pending Campaign; Resign withdraws it", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		res := etQueue(t, testCtx(t), cli, b)
		bKey := string(candidates(t, cli, etPrefix)[1].Key)
		ctx, cancel := context.WithTimeout(testCtx(t), time.Second*scale)
		defer cancel()
		if ok, err := b.TryCampaign(ctx, "b"); ok || err != nil {
			t.Fatalf("TryCampaign while a Campaign waits = %v, %v; want false, nil", ok, err)
		}
		if err := b.Proclaim(ctx, "b"); !errors.Is(err, ErrNotLeader) {
			t.Fatalf("Proclaim while a Campaign waits: %v, want ErrNotLeader", err)
		}
		if err := b.Resign(ctx); err != nil {
			t.Fatalf("Resign while a Campaign waits: %v", err)
		}
		if r := etWait(t, res); !errors.Is(r.err, ErrResigned) {
			t.Fatalf("Campaign withdrawn by Resign: %v, want ErrResigned", r.err)
		}
		etWaitCount(t, cli, bKey, 0)
		if b.Err() != nil {
			t.Fatalf("Err without a leadership: %v", b.Err())
		}
		if !a.IsLeader() {
			t.Fatal("a no longer leads")
		}
	})
	t.Run("Campaign leaves no key behind when its put lands after its ctx ended", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		tap, tapLog := newLogTap()
		e := etElection(t, p.NewClient(t), ElectionOptions{Logger: tapLog})
		old := etSession(e)
		// Held traffic is delivered after Unpause: the put may land late.
		p.Pause()
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := e.Campaign(ctx, "a")
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Campaign: %v, want DeadlineExceeded", err)
		}
		// It returns at its ctx; the withdrawal goes on in the background.
		if took := time.Since(start); took > 200*time.Millisecond+100*time.Millisecond*scale {
			t.Fatalf("Campaign returned %v after it was called, its ctx was 200ms", took)
		}
		// It could not withdraw the key: it gave up the session instead.
		waitClosed(t, old.ctx.Done(), "the session")
		p.Unpause()
		tap.wait(t, "coord: session released", 1)
		if ttl := etTTL(t, cli, old.id); ttl != -1 {
			t.Fatalf("old lease TTL %d, want -1 (revoked)", ttl)
		}
		etWantCands(t, cli, 0)
		etCampaign(t, e, "a")
	})
}

func TestElectionTryCampaign(t *testing.T) {
	t.Run("TryCampaign wins when nobody leads", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		ok, err := e.TryCampaign(testCtx(t), "a")
		if !ok || err != nil || !e.IsLeader() {
			t.Fatalf("TryCampaign = %v, %v; IsLeader %v", ok, err, e.IsLeader())
		}
		if got, err := e.Leader(testCtx(t)); err != nil || got != "a" {
			t.Fatalf("Leader = %q, %v; want a", got, err)
		}
	})
	t.Run("TryCampaign returns false at once when another leads and leaves no key", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		// A TryCampaign that waited would run into this deadline.
		ctx, cancel := context.WithTimeout(testCtx(t), 2*time.Second*scale)
		defer cancel()
		ok, err := b.TryCampaign(ctx, "b")
		if ok || err != nil {
			t.Fatalf("TryCampaign = %v, %v; want false, nil", ok, err)
		}
		if b.IsLeader() || b.Token() != 0 {
			t.Fatal("b leads")
		}
		cands := candidates(t, cli, etPrefix)
		if len(cands) != 1 || clientv3.LeaseID(cands[0].Lease) != etSession(a).id {
			t.Fatalf("candidates %v, want only a's", cands)
		}
	})
	t.Run("TryCampaign while leading returns true and proclaims", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		etCampaign(t, e, "a")
		if ok, err := e.TryCampaign(testCtx(t), "b"); !ok || err != nil {
			t.Fatalf("TryCampaign = %v, %v", ok, err)
		}
		if got, err := e.Leader(testCtx(t)); err != nil || got != "b" {
			t.Fatalf("Leader = %q, %v; want b", got, err)
		}
	})
}

func TestElectionResign(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("Resign ends leadership and a waiting candidate takes over", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		ctx := testCtx(t)
		token := a.Token()
		res := etQueue(t, ctx, cli, b)
		done := a.Done()
		if err := a.Resign(ctx); err != nil {
			t.Fatalf("Resign: %v", err)
		}
		waitClosed(t, done, "Done after Resign")
		if a.IsLeader() || a.Token() != 0 {
			t.Fatalf("after Resign: IsLeader %v, Token %d", a.IsLeader(), a.Token())
		}
		if r := etWait(t, res); r.err != nil {
			t.Fatalf("waiting Campaign: %v", r.err)
		}
		if !b.IsLeader() || b.Token() <= token {
			t.Fatalf("b: IsLeader %v, Token %d (a's was %d)", b.IsLeader(), b.Token(), token)
		}
		if got, err := a.Leader(ctx); err != nil || got != "b" {
			t.Fatalf("Leader = %q, %v; want b", got, err)
		}
	})
	t.Run("Resign when not leading returns nil", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		if err := e.Resign(testCtx(t)); err != nil {
			t.Fatalf("Resign before campaigning: %v", err)
		}
		etCampaign(t, e, "a")
		for i := 0; i < 2; i++ {
			if err := e.Resign(testCtx(t)); err != nil {
				t.Fatalf("Resign #%d: %v", i+1, err)
			}
		}
		etWantCands(t, cli, 0)
	})
	t.Run("Resign of a waiting Campaign returns once its candidate key is gone", func(t *testing.T) {
		srv, cli := newEtcd(t)
		a := etElection(t, cli, ElectionOptions{})
		etCampaign(t, a, "a")
		px := srv.NewProxy(t)
		b := etElection(t, px.NewClient(t), ElectionOptions{})
		ctx := testCtx(t)
		for i := range 3 {
			res := etQueue(t, ctx, cli, b)
			// A slow link: the withdrawal takes a round trip of 40 ms
			// after the Campaign has returned.
			px.Delay(20 * time.Millisecond)
			if err := b.Resign(ctx); err != nil {
				t.Fatalf("round %d: Resign: %v", i, err)
			}
			if n := len(candidates(t, cli, etPrefix)); n != 1 {
				t.Fatalf("round %d: %d candidates as Resign returned, want only the leader's", i, n)
			}
			if r := etWait(t, res); !errors.Is(r.err, ErrResigned) {
				t.Fatalf("round %d: Campaign: %v, want ErrResigned", i, r.err)
			}
			px.Delay(0)
		}
	})
	t.Run("Resign of a waiting Campaign whose withdrawal outlasts its ctx returns at its ctx; the key goes in the background", func(t *testing.T) {
		srv, cli := newEtcd(t)
		a := etElection(t, cli, ElectionOptions{})
		etCampaign(t, a, "a")
		px := srv.NewProxy(t)
		b := etElection(t, px.NewClient(t), ElectionOptions{TTL: 4 * time.Second})
		res := etQueue(t, testCtx(t), cli, b)
		// The withdrawal's round trip, 600 ms, outlasts Resign's ctx;
		// the session's renewals are answered well within two thirds of
		// its TTL.
		px.Delay(300 * time.Millisecond)
		ctx, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
		defer cancel()
		if err := b.Resign(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Resign: %v, want DeadlineExceeded", err)
		}
		if r := etWait(t, res); !errors.Is(r.err, ErrResigned) {
			t.Fatalf("Campaign: %v, want ErrResigned", r.err)
		}
		etWaitCount(t, cli, etPrefix, 1, clientv3.WithPrefix())
		if err := etSession(b).Err(); err != nil {
			t.Fatalf("the session ended: %v", err)
		}
	})
	t.Run("Resign refused by etcd returns the refusal and ends the session, whose lease takes the key", func(t *testing.T) {
		srv, _ := newEtcd(t)
		login := enableAuth(t, srv, map[string][]keyRange{"cand": {prefixRange(etPrefix)}})
		root, cand := login("root"), login("cand")
		e := etElection(t, cand, ElectionOptions{})
		etCampaign(t, e, "a")
		sess := etSession(e)
		if _, err := root.RoleRevokePermission(testCtx(t), "cand", etPrefix, clientv3.GetPrefixRangeEnd(etPrefix)); err != nil {
			t.Fatal(err)
		}
		if err := e.Resign(testCtx(t)); !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Fatalf("Resign: %v, want permission denied", err)
		}
		waitClosed(t, sess.ctx.Done(), "the session")
		etWaitCount(t, root, etPrefix, 0, clientv3.WithPrefix())
	})
	t.Run("Resign that cannot reach etcd ends our leadership at once; the key goes with the session once etcd answers", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		e := etElection(t, p.NewClient(t), ElectionOptions{})
		etCampaign(t, e, "a")
		key, done, sess := e.current().key, e.Done(), etSession(e)
		p.Blackhole()
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		if err := e.Resign(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Resign: %v, want DeadlineExceeded", err)
		}
		if took := time.Since(start); took > 200*time.Millisecond+100*time.Millisecond*scale {
			t.Fatalf("Resign returned %v after it was called, its ctx was 200ms", took)
		}
		waitClosed(t, done, "Done")
		if e.IsLeader() || !errors.Is(e.Err(), ErrResigned) {
			t.Fatalf("after Resign: IsLeader %v, Err %v", e.IsLeader(), e.Err())
		}
		waitClosed(t, sess.ctx.Done(), "the session")
		p.Unblackhole()
		etWaitCount(t, cli, key, 0)
	})
}

func TestElectionObserve(t *testing.T) {
	t.Run("Observe sends the current leader first and then each change", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		a := etElection(t, cli, ElectionOptions{})
		b := etElection(t, srv.NewClient(t), ElectionOptions{})
		c := etElection(t, srv.NewClient(t), ElectionOptions{})
		obs := a.Observe(ctx)
		etExpect(t, obs, "")
		etCampaign(t, a, "a")
		etExpect(t, obs, "a")
		if err := a.Proclaim(ctx, "a2"); err != nil {
			t.Fatal(err)
		}
		etExpect(t, obs, "a2")
		if err := a.Resign(ctx); err != nil {
			t.Fatal(err)
		}
		etExpect(t, obs, "")
		etCampaign(t, b, "b")
		etExpect(t, obs, "b")
		// A candidate joining changes nothing; its turn does.
		res := etCampaignAsync(ctx, c, "c")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		if err := b.Resign(ctx); err != nil {
			t.Fatal(err)
		}
		etExpect(t, obs, "c")
		if r := etWait(t, res); r.err != nil {
			t.Fatal(r.err)
		}
		etExpect(t, b.Observe(ctx), "c")
	})
	t.Run("Observe closes when its ctx ends", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		ctx, cancel := context.WithCancel(testCtx(t))
		obs := e.Observe(ctx)
		etExpect(t, obs, "")
		cancel()
		etDrained(t, obs)
		// The election is unharmed.
		etCampaign(t, e, "a")
	})
	t.Run("WatchClient carries Observe, standalone or pooled: closing it closes the channel, the election unharmed", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ws, wp := srv.NewClient(t), srv.NewClient(t)
		pool := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second, WatchClient: wp})
		for _, c := range []struct {
			name string
			e    *Election
			w    *clientv3.Client
		}{
			{"standalone", etElection(t, cli, ElectionOptions{Key: etKey + "-standalone", WatchClient: ws}), ws},
			{"pooled", ptElection(t, pool, etKey+"-pooled"), wp},
		} {
			obs := c.e.Observe(testCtx(t))
			etExpect(t, obs, "")
			etCampaign(t, c.e, c.name)
			etExpect(t, obs, c.name)
			if err := c.w.Close(); err != nil {
				t.Fatal(err)
			}
			etDrained(t, obs)
			if err := c.e.Resign(testCtx(t)); err != nil {
				t.Fatalf("%s: Resign after its WatchClient closed: %v", c.name, err)
			}
			etCampaign(t, c.e, c.name)
		}
	})
	t.Run("Observe closes on Close and is closed after it", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		etCampaign(t, e, "a")
		obs := e.Observe(testCtx(t))
		etExpect(t, obs, "a")
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		etDrained(t, obs)
		if _, ok := <-e.Observe(testCtx(t)); ok {
			t.Fatal("Observe after Close sent a value")
		}
	})
}

func TestElectionDone(t *testing.T) {
	t.Run("Done is closed when we do not lead", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		waitClosed(t, e.Done(), "Done before campaigning")
	})
	t.Run("Done closes when someone else deletes the leader key", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		etCampaign(t, e, "a")
		token, done := e.Token(), e.Done()
		if _, err := cli.Delete(testCtx(t), etPrefix, clientv3.WithPrefix()); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, done, "Done")
		if e.IsLeader() || e.Token() != 0 {
			t.Fatalf("IsLeader %v, Token %d after the key was deleted", e.IsLeader(), e.Token())
		}
		etCampaign(t, e, "a")
		if e.Token() <= token {
			t.Fatalf("new token %d, old %d", e.Token(), token)
		}
	})
	t.Run("Done closes when the session's lease is revoked", func(t *testing.T) {
		srv, _ := newEtcd(t)
		other := srv.NewClient(t)
		e := etElection(t, srv.Client(), ElectionOptions{})
		etCampaign(t, e, "a")
		old, done := etSession(e).id, e.Done()
		etRevoke(t, other, old)
		waitClosed(t, done, "Done")
		if e.IsLeader() {
			t.Fatal("leads after its lease was revoked")
		}
		etCampaign(t, e, "a")
		if etSession(e).id == old {
			t.Fatal("campaigned again on the revoked lease")
		}
	})
}

func TestElectionStepDown(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("A leader cut off from etcd steps down before a successor can win", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		// A slower CPU (emulation) gets a longer TTL: the margin below is
		// a third of it, less what the test itself takes to see Done.
		ttl := time.Second * scale
		a := etElection(t, p.NewClient(t), ElectionOptions{TTL: ttl})
		b := etElection(t, cli, ElectionOptions{TTL: ttl})
		etCampaign(t, a, "a")
		l := a.current()
		res := etQueue(t, testCtx(t), cli, b)
		done := a.Done()
		cut := time.Now()
		p.Blackhole()
		waitClosed(t, done, "Done of the leader cut off")
		stepped := time.Now()
		r := etWait(t, res)
		if r.err != nil {
			t.Fatalf("successor's Campaign: %v", r.err)
		}
		margin := r.at.Sub(stepped)
		t.Logf("stepped down %v after the cut; successor won %v after that", stepped.Sub(cut), margin)
		if margin <= 0 {
			t.Fatalf("the successor won %v before the old leader stepped down", -margin)
		}
		if d := stepped.Sub(cut); d > ttl {
			t.Fatalf("stepped down %v after the cut, want within the TTL %v (2/3 of it, plus the time to notice)", d, ttl)
		}
		if a.IsLeader() {
			t.Fatal("the old leader still believes it leads")
		}
		p.Unblackhole()
		etWaitCount(t, cli, l.key, 0)
		if got := etTTL(t, cli, l.sess.id); got != -1 {
			t.Fatalf("old lease TTL %d, want -1", got)
		}
		successor := b.Token()
		if err := b.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		etCampaign(t, a, "a again")
		if a.Token() <= successor {
			t.Fatalf("token %d after the successor's", a.Token())
		}
	})
	t.Run("A leader cut off from etcd removes its key as soon as etcd answers again", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		// Expiry would come a third of the TTL after the step-down at
		// the earliest: the time the revoke has, scaled on slow CPUs.
		ttl := 3 * time.Second * scale
		a := etElection(t, p.NewClient(t), ElectionOptions{TTL: ttl})
		etCampaign(t, a, "a")
		l := a.current()
		p.Blackhole()
		waitClosed(t, a.Done(), "Done of the leader cut off")
		stepped := time.Now()
		p.Unblackhole()
		etWaitCount(t, cli, l.key, 0)
		// etcd expires a lease a TTL after its last renewal at the
		// earliest; the leader steps down 2/3 of a TTL after it.
		gone := time.Since(stepped)
		t.Logf("key gone %v after stepping down", gone)
		if gone >= ttl/3 {
			t.Fatalf("key gone %v after stepping down: expired, not revoked", gone)
		}
	})
}

func TestElectionTokens(t *testing.T) {
	t.Run("Tokens strictly increase across successive leaders", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		es := make([]*Election, 4)
		for i := range es {
			es[i] = etElection(t, srv.NewClient(t), ElectionOptions{Identity: string(rune('a' + i))})
		}
		var tokens []int64
		check := func(e *Election) {
			t.Helper()
			l := e.current()
			if l == nil {
				t.Fatalf("%s does not lead", e.identity)
			}
			if got, err := e.Leader(ctx); err != nil || got != e.identity {
				t.Fatalf("Leader = %q, %v; want %s", got, err, e.identity)
			}
			if kv := candidates(t, cli, etPrefix)[0]; kv.CreateRevision != e.Token() {
				t.Fatalf("token %d, leader key created at %d", e.Token(), kv.CreateRevision)
			}
			tokens = append(tokens, e.Token())
		}
		etCampaign(t, es[0], "")
		check(es[0])
		res := make([]<-chan etResult, len(es))
		for i := 1; i < len(es); i++ {
			res[i] = etCampaignAsync(ctx, es[i], "")
			etWaitCount(t, cli, etPrefix, int64(i+1), clientv3.WithPrefix())
		}
		// Handovers: by Resign, by key deletion, by lease revocation,
		// by Close.
		if err := es[0].Resign(ctx); err != nil {
			t.Fatal(err)
		}
		etWait(t, res[1])
		check(es[1])
		if _, err := cli.Delete(ctx, es[1].current().key); err != nil {
			t.Fatal(err)
		}
		etWait(t, res[2])
		check(es[2])
		etRevoke(t, cli, es[2].current().sess.id)
		etWait(t, res[3])
		check(es[3])
		res[0] = etCampaignAsync(ctx, es[0], "")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		es[3].Close()
		etWait(t, res[0])
		check(es[0])
		for i := 1; i < len(tokens); i++ {
			if tokens[i] <= tokens[i-1] {
				t.Fatalf("tokens %v do not strictly increase", tokens)
			}
		}
	})
}

func TestElectionGuard(t *testing.T) {
	t.Run("A Txn under Guard succeeds while leading and fails after Resign", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		etCampaign(t, e, "a")
		g := e.Guard()
		if !etGuarded(t, cli, g) || !etGuarded(t, cli, e.Guard()) {
			t.Fatal("guarded Txn failed while leading")
		}
		if err := e.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if etGuarded(t, cli, g) || etGuarded(t, cli, e.Guard()) {
			t.Fatal("guarded Txn succeeded after Resign")
		}
		// A guard of an earlier term fails in a later one.
		etCampaign(t, e, "a")
		if etGuarded(t, cli, g) || !etGuarded(t, cli, e.Guard()) {
			t.Fatal("a guard held in the wrong term")
		}
		// A new identity proclaimed is the same term: Guard still holds.
		g = e.Guard()
		if err := e.Proclaim(testCtx(t), "a2"); err != nil {
			t.Fatal(err)
		}
		if !etGuarded(t, cli, g) || !etGuarded(t, cli, e.Guard()) {
			t.Fatal("Guard no longer holds after a Proclaim while leading")
		}
	})
	t.Run("A Txn under Guard fails once the leader key is deleted", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		etCampaign(t, e, "a")
		g := e.Guard()
		if _, err := cli.Delete(testCtx(t), e.current().key); err != nil {
			t.Fatal(err)
		}
		// At once, before e has even noticed.
		if etGuarded(t, cli, g) {
			t.Fatal("guarded Txn succeeded after the leader key was deleted")
		}
		waitClosed(t, e.Done(), "Done")
		if etGuarded(t, cli, e.Guard()) {
			t.Fatal("Guard holds after leadership ended")
		}
	})
	t.Run("Guard never holds when never leader", func(t *testing.T) {
		srv, cli := newEtcd(t)
		leader := etElection(t, srv.NewClient(t), ElectionOptions{})
		e := etElection(t, cli, ElectionOptions{})
		if etGuarded(t, cli, e.Guard()) {
			t.Fatal("Guard held with no leader")
		}
		etCampaign(t, leader, "l")
		if _, err := cli.Put(testCtx(t), etPrefix, "the prefix key itself"); err != nil {
			t.Fatal(err)
		}
		if etGuarded(t, cli, e.Guard()) {
			t.Fatal("Guard of a non-leader held")
		}
	})
}

func TestElectionInterop(t *testing.T) {
	t.Run("A concurrency Election and ours see each other's leaders", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		cs, err := concurrency.NewSession(srv.NewClient(t), concurrency.WithTTL(2))
		if err != nil {
			t.Fatal(err)
		}
		defer cs.Close()
		theirs := concurrency.NewElection(cs, etKey)
		ours := etElection(t, cli, ElectionOptions{})

		etCampaign(t, ours, "ours")
		if r, err := theirs.Leader(ctx); err != nil || string(r.Kvs[0].Value) != "ours" {
			t.Fatalf("their Leader = %v, %v; want ours", r, err)
		}
		// They wait behind us...
		errc := make(chan error, 1)
		go func() { errc <- theirs.Campaign(ctx, "theirs") }()
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		obs := ours.Observe(ctx)
		etExpect(t, obs, "ours")
		if err := ours.Resign(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-errc; err != nil {
			t.Fatalf("their Campaign: %v", err)
		}
		if got, err := ours.Leader(ctx); err != nil || got != "theirs" {
			t.Fatalf("our Leader = %q, %v; want theirs", got, err)
		}
		etExpect(t, obs, "theirs")
		// ...and we wait behind them.
		res := etCampaignAsync(ctx, ours, "ours again")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		peer := etElection(t, cli, ElectionOptions{})
		if ok, err := peer.TryCampaign(ctx, "x"); ok || err != nil {
			t.Fatalf("TryCampaign while they lead = %v, %v; want false, nil", ok, err)
		}
		if err := theirs.Resign(ctx); err != nil {
			t.Fatal(err)
		}
		if r := etWait(t, res); r.err != nil {
			t.Fatal(r.err)
		}
		if r, err := theirs.Leader(ctx); err != nil || string(r.Kvs[0].Value) != "ours again" {
			t.Fatalf("their Leader = %v, %v; want ours again", r, err)
		}
	})
}

func TestElectionClose(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("Close is idempotent, resigns and releases the session", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		l, done := a.current(), a.Done()
		res := etQueue(t, testCtx(t), cli, b)
		for i := 0; i < 2; i++ {
			if err := a.Close(); err != nil {
				t.Fatalf("Close #%d: %v", i+1, err)
			}
		}
		// Released by the time Close returns.
		if got := etTTL(t, cli, l.sess.id); got != -1 {
			t.Fatalf("lease TTL %d after Close, want -1", got)
		}
		if resp, err := cli.Get(testCtx(t), l.key); err != nil || len(resp.Kvs) != 0 {
			t.Fatalf("leader key after Close: %v, %v", resp, err)
		}
		waitClosed(t, done, "Done")
		if a.IsLeader() {
			t.Fatal("leads after Close")
		}
		if r := etWait(t, res); r.err != nil || !b.IsLeader() {
			t.Fatalf("waiter: %v, IsLeader %v", r.err, b.IsLeader())
		}
	})
	t.Run("A Campaign waiting on a closed election returns ErrClosed and leaves no key", func(t *testing.T) {
		_, cli, _, b := etRivals(t)
		res := etQueue(t, testCtx(t), cli, b)
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		if r := etWait(t, res); !errors.Is(r.err, ErrClosed) {
			t.Fatalf("Campaign: %v, want ErrClosed", r.err)
		}
		etWantCands(t, cli, 1)
	})
	t.Run("methods after Close return ErrClosed", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		etCampaign(t, e, "a")
		g := e.Guard()
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		ctx := testCtx(t)
		errc := make(chan error, 1)
		go func() {
			// Over and over: a call after Close must leave things as it
			// found them for the next one.
			for i := 0; i < 20; i++ {
				if err := e.Campaign(ctx, "a"); !errors.Is(err, ErrClosed) {
					errc <- err
					return
				}
				if _, err := e.TryCampaign(ctx, "a"); !errors.Is(err, ErrClosed) {
					errc <- err
					return
				}
				if err := e.Proclaim(ctx, "a"); !errors.Is(err, ErrClosed) {
					errc <- err
					return
				}
				if err := e.Resign(ctx); !errors.Is(err, ErrClosed) {
					errc <- err
					return
				}
				if _, err := e.Leader(ctx); !errors.Is(err, ErrClosed) {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
		select {
		case err := <-errc:
			if err != nil {
				t.Fatalf("call after Close: %v, want ErrClosed", err)
			}
		case <-time.After(patience()):
			t.Fatal("a call after Close hangs")
		}
		if e.IsLeader() || e.Token() != 0 || etGuarded(t, cli, g) || etGuarded(t, cli, e.Guard()) {
			t.Fatal("still leads after Close")
		}
		waitClosed(t, e.Done(), "Done")
		etDrained(t, e.Observe(ctx))
		etWantCands(t, cli, 0)
	})
	t.Run("Close returns in about a TTL while a call is stuck on an unreachable etcd", func(t *testing.T) {
		srv, _ := newEtcd(t)
		p := srv.NewProxy(t)
		pcli, hooks := etHookedClient(t, p.ClientConfig())
		const ttl = time.Second
		e := etElection(t, pcli, ElectionOptions{TTL: ttl})
		renewing := make(chan struct{})
		hooks.on("/etcdserverpb.Lease/LeaseKeepAlive", func() { close(renewing) })
		p.Blackhole()
		defer p.Unblackhole()
		res := etCampaignAsync(context.Background(), e, "a")
		eventually(t, "campaigning", func() bool { return len(e.turn) == 1 })
		// Close while a renewal hangs too.
		waitClosed(t, renewing, "renewal")
		start := time.Now()
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		t.Logf("Close took %v", took)
		if took > 3*ttl*scale {
			t.Fatalf("Close took %v, want about the TTL %v", took, ttl)
		}
		if r := etWait(t, res); !errors.Is(r.err, ErrClosed) {
			t.Fatalf("Campaign: %v, want ErrClosed", r.err)
		}
	})
	t.Run("Closing the client ends leadership", func(t *testing.T) {
		srv, cli := newEtcd(t)
		mine := srv.NewClient(t)
		a := etElection(t, mine, ElectionOptions{TTL: time.Second})
		idle := etElection(t, mine, ElectionOptions{TTL: time.Second})
		b := etElection(t, cli, ElectionOptions{})
		etCampaign(t, a, "a")
		obs := a.Observe(testCtx(t))
		etExpect(t, obs, "a")
		res := etQueue(t, testCtx(t), cli, b)
		done := a.Done()
		mine.Close()
		waitClosed(t, done, "Done")
		// A session without leadership notices at its next renewal.
		s := etSession(idle)
		waitClosed(t, s.ctx.Done(), "the idle election's session")
		if !errors.Is(s.Err(), ErrClientClosed) {
			t.Fatalf("idle session ended: %v, want ErrClientClosed", s.Err())
		}
		if a.IsLeader() {
			t.Fatal("leads on a closed client")
		}
		etDrained(t, obs)
		// etcd expires the lease nobody can revoke; b takes over.
		if r := etWait(t, res); r.err != nil {
			t.Fatal(r.err)
		}
		if err := a.Campaign(testCtx(t), "a"); !errors.Is(err, ErrClientClosed) {
			t.Fatalf("Campaign on a closed client: %v, want ErrClientClosed", err)
		}
		start := time.Now()
		a.Close()
		if took := time.Since(start); took > 2*time.Second*scale {
			t.Fatalf("Close took %v", took)
		}
	})
}

func TestElectionBrokenWatch(t *testing.T) {
	// After a compaction past the revision a watch would resume from, an
	// etcd restart breaks the watch for good (ErrCompacted).
	compact := func(t *testing.T, srv *coordtest.Server, cli *clientv3.Client) {
		t.Helper()
		for i := 0; i < 2; i++ {
			if _, err := cli.Put(testCtx(t), "/coord/test/other", "x"); err != nil {
				t.Fatal(err)
			}
		}
		srv.Compact(testCtx(t))
	}
	compactAndRestart := func(t *testing.T, srv *coordtest.Server, cli *clientv3.Client) {
		t.Helper()
		compact(t, srv, cli)
		srv.Restart()
	}
	t.Run("A leader whose watch breaks checks its key and leads on", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		tap, tapLog := newLogTap()
		// The session must not go stale while etcd restarts (slower
		// under emulation): a TTL scaled with the suite's deadlines.
		e := etElection(t, cli, ElectionOptions{TTL: 3 * time.Second * scale, Logger: tapLog})
		etCampaign(t, e, "a")
		obs := e.Observe(ctx)
		etExpect(t, obs, "a")
		compactAndRestart(t, srv, cli)
		tap.wait(t, "coord: leader watch broke, watching on", 1)
		if !e.IsLeader() || !etGuarded(t, cli, e.Guard()) {
			t.Fatal("stepped down although the leader key is there")
		}
		// Observe lists again and watches on.
		if err := e.Proclaim(ctx, "a2"); err != nil {
			t.Fatal(err)
		}
		etExpect(t, obs, "a2")
		// The new watch still ends leadership when the key goes.
		if _, err := cli.Delete(ctx, e.current().key); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, e.Done(), "Done")
		etExpect(t, obs, "")
	})
	t.Run("A leader whose key went while its watch was broken steps down", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		// The session must not go stale meanwhile: a long TTL.
		e := etElection(t, p.NewClient(t), ElectionOptions{TTL: 6 * time.Second})
		etCampaign(t, e, "a")
		s, done := etSession(e), e.Done()
		// The delete event is lost on the way: compacted away before the
		// cut connection is reset, so the resumed watch breaks
		// (ErrCompacted) instead of delivering it.
		p.Blackhole()
		if _, err := cli.Delete(testCtx(t), e.current().key); err != nil {
			t.Fatal(err)
		}
		compact(t, srv, cli)
		p.Unblackhole()
		waitClosed(t, done, "Done")
		if s.ctx.Err() != nil {
			t.Fatalf("session ended (%v): the step-down was not the key's", s.Err())
		}
	})
}

func TestElectionPermissionDenied(t *testing.T) {
	t.Parallel()
	t.Run("A candidate that may not read the election fails, leaves no key, and Observe retries", func(t *testing.T) {
		srv, _ := newEtcd(t)
		ctx := testCtx(t)
		// The candidate's role covers candidate keys (lease ids in hex
		// never start with 0) but not the whole prefix.
		login := enableAuth(t, srv, map[string][]keyRange{"cand": {{etPrefix + "1", clientv3.GetPrefixRangeEnd(etPrefix)}}})
		root, cand := login("root"), login("cand")
		must := mustOK(t)
		tap, tapLog := newLogTap()
		e := etElection(t, cand, ElectionOptions{Logger: tapLog})

		err := e.Campaign(ctx, "a")
		if !errors.Is(err, rpctypes.ErrPermissionDenied) || errors.Is(err, ErrLeadershipLost) {
			t.Fatalf("Campaign: %v, want permission denied", err)
		}
		if n := len(candidates(t, root, etPrefix)); n != 0 {
			t.Fatalf("%d candidates, want 0", n)
		}
		if _, err := e.Leader(ctx); !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Fatalf("Leader: %v, want permission denied", err)
		}
		// Both observers end before the clients close (see below).
		lctx, lcancel := context.WithCancel(ctx)
		obs := e.Observe(lctx)
		defer func() { lcancel(); etDrained(t, obs) }()
		octx, ocancel := context.WithCancel(ctx)
		short := e.Observe(octx)
		// Each observer warns of each refusal, and retries with backoff:
		// of six warnings, one observer gave three at least, the third a
		// first and a second delay after its first.
		const refused = "coord: observe: etcd refuses, retrying"
		tap.wait(t, refused, 6)
		rs := tap.records(refused)
		for _, r := range rs {
			if r.Level != slog.LevelWarn {
				t.Fatalf("%q logged at level %v, want WARN", refused, r.Level)
			}
		}
		if span, least := rs[5].Time.Sub(rs[0].Time), minBackoff/2+minBackoff; span < least {
			t.Fatalf("six refusals within %v, want at least %v apart (backoff)", span, least)
		}
		ocancel()
		etDrained(t, short)
		must(root.RoleGrantPermission(ctx, "cand", etPrefix, clientv3.GetPrefixRangeEnd(etPrefix),
			clientv3.PermissionType(clientv3.PermRead)))
		etExpect(t, obs, "")
		etCampaign(t, e, "a")
		etExpect(t, obs, "a")
		// The observer ends before the restart, which leaves the leader's
		// watch alone on the client's watch stream: etcd's client (v3.7.3)
		// can lose track of one of several watches refused on resumption,
		// never close its channel, and then wedge its Close (seen once, on
		// riscv64 under emulation; the observer now ends on its ctx alone).
		lcancel()
		etDrained(t, obs)

		// A leader that may no longer watch its key steps down, and its key
		// goes with its lease, rather than spinning.
		key := e.current().key
		must(root.RoleRevokePermission(ctx, "cand", etPrefix, clientv3.GetPrefixRangeEnd(etPrefix)))
		must(root.RoleRevokePermission(ctx, "cand", etPrefix+"1", clientv3.GetPrefixRangeEnd(etPrefix)))
		srv.Restart() // existing watches keep their rights; resumed ones do not
		waitClosed(t, e.Done(), "Done of a leader refused its key")
		etWaitCount(t, root, key, 0)
	})
}

func TestNewElection(t *testing.T) {
	t.Run("bad input is refused and nothing is written", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		if _, err := NewElection(ctx, nil, ElectionOptions{Key: etKey}); !errors.Is(err, ErrNilClient) {
			t.Fatalf("nil client: %v, want ErrNilClient", err)
		}
		for _, key := range []string{"", "a/", "a//b", "/"} {
			if _, err := NewElection(ctx, cli, ElectionOptions{Key: key}); !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("key %q: %v, want ErrInvalidKey", key, err)
			}
		}
		for _, ttl := range []time.Duration{-time.Second, 1500 * time.Millisecond, time.Millisecond} {
			if _, err := NewElection(ctx, cli, ElectionOptions{Key: etKey, TTL: ttl}); !errors.Is(err, ErrInvalidTTL) {
				t.Fatalf("TTL %v: %v, want ErrInvalidTTL", ttl, err)
			}
		}
		if n := keyCount(t, cli, ""); n != 0 {
			t.Fatalf("%d keys written", n)
		}
		if ls, err := cli.Leases(ctx); err != nil || len(ls.Leases) != 0 {
			t.Fatalf("leases %v, %v; want none", ls, err)
		}
	})
	t.Run("an ended ctx fails it with the ctx's error", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, cancel := context.WithCancel(testCtx(t))
		cancel()
		if _, err := NewElection(ctx, cli, ElectionOptions{Key: etKey}); !errors.Is(err, context.Canceled) {
			t.Fatalf("NewElection: %v, want context.Canceled", err)
		}
		if ls, err := cli.Leases(testCtx(t)); err != nil || len(ls.Leases) != 0 {
			t.Fatalf("leases %v, %v; want none", ls, err)
		}
	})
	t.Run("the zero options take a 10s TTL and the host name", func(t *testing.T) {
		_, cli := newEtcd(t)
		e, err := NewElection(testCtx(t), cli, ElectionOptions{Key: etKey})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		ttl, err := cli.TimeToLive(testCtx(t), etSession(e).id)
		if err != nil || ttl.GrantedTTL != 10 {
			t.Fatalf("granted TTL %v, %v; want 10", ttl, err)
		}
		etCampaign(t, e, "")
		host, _ := os.Hostname()
		if got, err := e.Leader(testCtx(t)); err != nil || got != host {
			t.Fatalf("Leader = %q, %v; want %q", got, err, host)
		}
	})
}

func TestElectionContract(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("A session lease granted after its caller gave up is revoked", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		// A slow link: etcd carries the grant out, and NewElection gives
		// up while the answer is on its way back. The TTL is past the
		// test's patience: only a revoke removes the lease in time.
		slow := p.NewClient(t)
		if _, err := slow.Get(testCtx(t), etKey); err != nil {
			t.Fatal(err) // the connection is up before the link slows
		}
		delay := 300 * time.Millisecond * scale
		p.Delay(delay)
		ctx, cancel := context.WithTimeout(testCtx(t), delay*3/2)
		defer cancel()
		if _, err := NewElection(ctx, slow, ElectionOptions{Key: etKey, TTL: 2 * patience()}); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("NewElection on a slow link: %v, want DeadlineExceeded", err)
		}
		leases := func() int {
			ctx, cancel := context.WithTimeout(context.Background(), patience())
			defer cancel()
			ls, err := cli.Leases(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return len(ls.Leases)
		}
		if n := leases(); n != 1 {
			t.Fatalf("%d leases once NewElection gave up, want the one etcd granted", n)
		}
		p.Delay(0)
		eventually(t, "no lease left", func() bool { return leases() == 0 })
	})
	t.Run("A session granted late is renewed at once, and the leadership gained on it lasts", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		ttl := time.Second * scale
		hcli, hooks := etHookedClient(t, p.ClientConfig())
		e := etElection(t, hcli, ElectionOptions{TTL: ttl})
		old := etSession(e)
		etRevoke(t, cli, old.id)
		waitClosed(t, old.ctx.Done(), "the revoked session")
		// The next grant is held by the link for longer than 2/3 of the
		// TTL, as in an outage, and the first renewal after it fails at
		// once, as on a member that has no leader yet.
		granting := make(chan time.Time, 1)
		var regranted atomic.Bool // a second session: the late one was given up
		hooks.on("/etcdserverpb.Lease/LeaseGrant", func() {
			p.Pause()
			granting <- time.Now()
			hooks.on("/etcdserverpb.Lease/LeaseGrant", func() { regranted.Store(true) })
		})
		hooks.onErr("/etcdserverpb.Lease/LeaseKeepAlive", func() error { return rpctypes.ErrGRPCNoLeader })
		res := etCampaignAsync(testCtx(t), e, "a")
		sent := <-granting
		<-time.After(time.Until(sent.Add(2*ttl/3 + 100*time.Millisecond)))
		p.Unpause()
		if r := etWait(t, res); r.err != nil {
			t.Fatalf("Campaign: %v", r.err)
		}
		l := e.current()
		if l == nil {
			t.Fatal("Campaign returned nil but we do not lead")
		}
		eventually(t, "a renewal answered", func() bool { return l.sess.k.lastAnswer().After(sent) })
		etOpen(t, l.ctx.Done(), "Done of the leadership on the late session")
		if !e.IsLeader() || !etGuarded(t, cli, e.Guard()) {
			t.Fatal("the leadership on the late session did not last")
		}
		if regranted.Load() {
			t.Fatal("Campaign gave the late session up and led on another")
		}
	})
	t.Run("A Campaign whose ctx ends while its late session awaits its first renewal returns at once and leaves no key", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		ttl := time.Second * scale
		hcli, hooks := etHookedClient(t, p.ClientConfig())
		tap, log := newLogTap()
		e := etElection(t, hcli, ElectionOptions{TTL: ttl, Logger: log})
		old := etSession(e)
		etRevoke(t, cli, old.id)
		waitClosed(t, old.ctx.Done(), "the revoked session")
		granting := make(chan time.Time, 1)
		hooks.on("/etcdserverpb.Lease/LeaseGrant", func() { p.Pause(); granting <- time.Now() })
		release := make(chan struct{})
		defer close(release)
		hooks.onErr("/etcdserverpb.Lease/LeaseKeepAlive", func() error { <-release; return rpctypes.ErrGRPCNoLeader })
		ctx, cancel := context.WithCancel(testCtx(t))
		res := etCampaignAsync(ctx, e, "a")
		sent := <-granting
		<-time.After(time.Until(sent.Add(2*ttl/3 + 100*time.Millisecond)))
		p.Unpause()
		tap.wait(t, "coord: campaign waits for its session's renewals to be answered", 1)
		cancel()
		cancelled := time.Now()
		r := etWait(t, res)
		if !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Campaign: %v, want context.Canceled", r.err)
		}
		if took := r.at.Sub(cancelled); took > 100*time.Millisecond*scale {
			t.Fatalf("Campaign returned %v after its ctx ended", took)
		}
		etWaitCount(t, cli, etPrefix, 0, clientv3.WithPrefix())
	})
	t.Run("TryCampaign and Campaign that cannot get a session return within their ctx", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		e := etElection(t, p.NewClient(t), ElectionOptions{TTL: time.Second})
		old := etSession(e)
		etRevoke(t, cli, old.id)
		waitClosed(t, old.ctx.Done(), "the revoked session")
		p.Blackhole()
		defer p.Unblackhole()
		for _, try := range []bool{true, false} {
			ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
			start := time.Now()
			var err error
			if try {
				_, err = e.TryCampaign(ctx, "a")
			} else {
				err = e.Campaign(ctx, "a")
			}
			took := time.Since(start)
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) || strings.Count(err.Error(), "coord:") != 1 {
				t.Fatalf("try %v: %v, want DeadlineExceeded with one \"coord:\"", try, err)
			}
			if took > 200*time.Millisecond+100*time.Millisecond*scale {
				t.Fatalf("try %v returned %v after it was called, its ctx was 200ms", try, took)
			}
		}
	})
	t.Run("A session that ends as the candidate put is answered is not led on: Campaign leads on a new one", func(t *testing.T) {
		srv, _ := newEtcd(t)
		hcli, hooks := etHookedClient(t, srv.ClientConfig())
		e := etElection(t, hcli, ElectionOptions{})
		first := etSession(e)
		// Nobody is ahead, so no turn is waited for: the session's end is
		// seen only by the check before leading.
		hooks.onAnswer("/etcdserverpb.KV/Txn", func() { first.end(errors.New("test: session ended")) })
		etCampaign(t, e, "a")
		l := e.current()
		if l == nil || l.sess == first || !e.IsLeader() {
			t.Fatalf("Campaign returned nil, leading on the ended session: %v", l != nil && l.sess == first)
		}
		etOpen(t, e.Done(), "Done of the leadership")
	})
	t.Run("A candidacy given up is withdrawn before the next one is put: the next never leads on the key being withdrawn", func(t *testing.T) {
		srv, cli := newEtcd(t)
		a := etElection(t, cli, ElectionOptions{})
		hcli, hooks := etHookedClient(t, srv.ClientConfig())
		tap, log := newLogTap()
		// A TTL well past the waits below: the held delete is not given up.
		b := etElection(t, hcli, ElectionOptions{TTL: 10 * time.Second * scale, Logger: log})
		etCampaign(t, a, "a")
		ctx, cancel := context.WithCancel(testCtx(t))
		res := etCampaignAsync(ctx, b, "b")
		tap.wait(t, "coord: campaign waits for its turn", 1)
		old := candidates(t, cli, etPrefix)[1].CreateRevision
		// b gives up; the delete of its key, which its ctx could not
		// carry, goes on in the background and is held on its way.
		release := make(chan struct{})
		hooks.holdDelete(release)
		cancel()
		if r := etWait(t, res); !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Campaign: %v, want Canceled", r.err)
		}
		// a resigns: b's old key, still there, is now the first.
		if err := a.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		tctx, tcancel := context.WithTimeout(testCtx(t), 200*time.Millisecond*scale)
		defer tcancel()
		if won, err := b.TryCampaign(tctx, "b"); won || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("TryCampaign while the old key is being withdrawn: %v, %v; want false, DeadlineExceeded", won, err)
		}
		close(release)
		if won, err := b.TryCampaign(testCtx(t), "b"); !won || err != nil {
			t.Fatalf("TryCampaign once the old key is gone: %v, %v; want true, nil", won, err)
		}
		if cands := candidates(t, cli, etPrefix); len(cands) != 1 || cands[0].CreateRevision <= old || b.Token() != cands[0].CreateRevision {
			t.Fatalf("candidates %v, token %d; want one key, put after the old one (%d), whose revision is the token", cands, b.Token(), old)
		}
		etOpen(t, b.Done(), "Done of b's leadership")
	})
	t.Run("A candidate put whose answer is lost is sent again: TryCampaign leads on the key the first put left, and the session lives on", func(t *testing.T) {
		srv, cli := newEtcd(t)
		hcli, hooks := etHookedClient(t, srv.ClientConfig())
		e := etElection(t, hcli, ElectionOptions{})
		s := etSession(e)
		hooks.loseAnswer("/etcdserverpb.KV/Txn")
		var created int64
		hooks.onAnswer("/etcdserverpb.KV/Txn", func() {
			if resp, err := cli.Get(testCtx(t), etPrefix); err == nil {
				created = resp.Header.Revision
			}
		})
		if ok, err := e.TryCampaign(testCtx(t), "a"); !ok || err != nil {
			t.Fatalf("TryCampaign with its answer lost = %v, %v; want true, nil", ok, err)
		}
		if cands := candidates(t, cli, etPrefix); len(cands) != 1 || cands[0].CreateRevision != created || e.Token() != created {
			t.Fatalf("candidates %v, token %d; want one key, created by the first put at %d", cands, e.Token(), created)
		}
		if s.ctx.Err() != nil || etSession(e) != s {
			t.Fatalf("the session ended (%v)", s.Err())
		}
	})
	t.Run("a second Campaign of one Election waits for the first, within its own ctx", func(t *testing.T) {
		_, cli, a, b := etRivals(t)
		res := etQueue(t, testCtx(t), cli, b)
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		if err := b.Campaign(ctx, "b2"); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("second Campaign: %v, want DeadlineExceeded", err)
		}
		if took := time.Since(start); took > 200*time.Millisecond+100*time.Millisecond*scale {
			t.Fatalf("second Campaign returned after %v, its ctx was 200ms", took)
		}
		etHandOver(t, a, b, res)
	})
	t.Run("a Campaign whose ctx ends as it meets another error returns both", func(t *testing.T) {
		srv, cli := newEtcd(t)
		hcli, hooks := etHookedClient(t, srv.ClientConfig())
		e := etElection(t, hcli, ElectionOptions{})
		old := etSession(e)
		etRevoke(t, cli, old.id)
		waitClosed(t, old.ctx.Done(), "the revoked session")
		ctx, cancel := context.WithCancel(testCtx(t))
		defer cancel()
		// etcd refuses the grant for now (retried after a backoff of at
		// least 25 ms); ctx ends during that backoff.
		hooks.onErr("/etcdserverpb.Lease/LeaseGrant", func() error {
			time.AfterFunc(10*time.Millisecond, cancel)
			return rpctypes.ErrGRPCRequestTooManyRequests
		})
		err := e.Campaign(ctx, "a")
		if !errors.Is(err, context.Canceled) || !errors.Is(err, rpctypes.ErrTooManyRequests) {
			t.Fatalf("Campaign: %v, want context.Canceled and the grant's error", err)
		}
	})
	t.Run("Err says why the latest leadership ended", func(t *testing.T) {
		_, cli := newEtcd(t)
		e := etElection(t, cli, ElectionOptions{})
		if e.Err() != nil {
			t.Fatalf("Err before any leadership: %v", e.Err())
		}
		etCampaign(t, e, "a")
		if e.Err() != nil {
			t.Fatalf("Err while leading: %v", e.Err())
		}
		etRevoke(t, cli, etSession(e).id)
		waitClosed(t, e.Done(), "Done")
		if err := e.Err(); !errors.Is(err, ErrLeadershipLost) {
			t.Fatalf("Err after the lease was revoked: %v, want ErrLeadershipLost", err)
		}
		etCampaign(t, e, "a")
		if err := e.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if err := e.Err(); !errors.Is(err, ErrResigned) {
			t.Fatalf("Err after Resign: %v, want ErrResigned", err)
		}
		etCampaign(t, e, "a")
		e.Close()
		if err := e.Err(); !errors.Is(err, ErrClosed) {
			t.Fatalf("Err after Close: %v, want ErrClosed", err)
		}
	})
}
