package coord

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// renewer renews, over one long-lived LeaseKeepAlive stream of a client,
// every lease coord holds on that client: registrations, elections and
// pool sessions alike. A renewal is one request on the stream, its answer
// the next response for that lease (etcd answers a stream's requests in
// order), so each keeper knows when the request it was answered for was
// sent. A broken stream fails the tries in flight and is opened again by
// the next try, with WithRequireLeader: a member cut off from its peers
// ends the stream at once, and the next one goes to another member.
type renewer struct {
	cli  *clientv3.Client
	refs int // keepers using it; guarded by renewers.mu

	mu      sync.Mutex
	stream  *renewStream  // nil until the next try opens one
	opening chan struct{} // closed when an opening under way ends
}

// renewStream is one LeaseKeepAlive stream and the tries waiting for its
// answers, per lease in the order they were sent.
type renewStream struct {
	pb      pb.Lease_LeaseKeepAliveClient
	cancel  context.CancelFunc
	done    chan struct{} // closed when its receiver returns: the stream broke
	err     error         // why it broke; set before done is closed
	sendMu  sync.Mutex
	mu      sync.Mutex
	waiting map[clientv3.LeaseID][]chan error
}

// renewers holds the renewer of each client that has leases of coord's.
var renewers = struct {
	mu sync.Mutex
	m  map[*clientv3.Client]*renewer
}{m: map[*clientv3.Client]*renewer{}}

// acquireRenewer returns the client's renewer, counting one more user.
func acquireRenewer(cli *clientv3.Client) *renewer {
	renewers.mu.Lock()
	defer renewers.mu.Unlock()
	r := renewers.m[cli]
	if r == nil {
		r = &renewer{cli: cli}
		renewers.m[cli] = r
	}
	r.refs++
	return r
}

// release counts one user less; the last one closes the stream.
func (r *renewer) release() {
	renewers.mu.Lock()
	r.refs--
	last := r.refs == 0
	if last {
		delete(renewers.m, r.cli)
	}
	renewers.mu.Unlock()
	if !last {
		return
	}
	r.mu.Lock()
	st := r.stream
	r.stream = nil
	r.mu.Unlock()
	if st != nil {
		st.cancel()
		<-st.done
	}
}

// renew sends one renewal of id and waits for its answer: nil once etcd
// renewed the lease, an error wrapping rpctypes.ErrLeaseNotFound once the
// lease is gone, or why the stream or ctx ended first. A try given up by
// ctx keeps its place: its answer, if it comes, is not taken for another's.
func (r *renewer) renew(ctx context.Context, id clientv3.LeaseID) error {
	st, err := r.open(ctx)
	if err != nil {
		return err
	}
	ch := make(chan error, 1)
	st.mu.Lock()
	st.waiting[id] = append(st.waiting[id], ch)
	st.mu.Unlock()
	// A failed send breaks the stream: its receiver returns then.
	st.sendMu.Lock()
	_ = st.pb.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)})
	st.sendMu.Unlock()
	select {
	case err := <-ch:
		return err
	case <-st.done:
		return st.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// open returns the live stream, opening one (bounded by ctx) if there is
// none. One caller opens; the others wait for it, within their ctx.
func (r *renewer) open(ctx context.Context) (*renewStream, error) {
	for {
		r.mu.Lock()
		st, opening := r.stream, r.opening
		if st == nil && opening == nil {
			r.opening = make(chan struct{})
		}
		r.mu.Unlock()
		switch {
		case st != nil:
			return st, nil
		case opening == nil:
			return r.dial(ctx)
		}
		select {
		case <-opening:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// dial opens a stream and publishes it; called by the one opener.
func (r *renewer) dial(ctx context.Context) (*renewStream, error) {
	sctx, cancel := context.WithCancel(clientv3.WithRequireLeader(context.Background()))
	// The stream outlives ctx, but its opening must not.
	stop := context.AfterFunc(ctx, cancel)
	s, err := pb.NewLeaseClient(r.cli.ActiveConnection()).LeaseKeepAlive(sctx)
	stopped := stop()
	r.mu.Lock()
	defer r.mu.Unlock()
	close(r.opening)
	r.opening = nil
	if err != nil || !stopped {
		cancel()
		return nil, fmt.Errorf("open renewal stream: %w", errors.Join(err, ctx.Err()))
	}
	st := &renewStream{pb: s, cancel: cancel, done: make(chan struct{}), waiting: map[clientv3.LeaseID][]chan error{}}
	r.stream = st
	go r.receive(st)
	return st, nil
}

// receive hands each answer of st to the try it answers, until st
// breaks; then it forgets st, and the tries still waiting on it fail.
func (r *renewer) receive(st *renewStream) {
	defer close(st.done)
	for {
		resp, err := st.pb.Recv()
		if err != nil {
			r.mu.Lock()
			if r.stream == st {
				r.stream = nil
			}
			r.mu.Unlock()
			st.cancel()
			st.err = fmt.Errorf("renewal stream: %w", err)
			return
		}
		id := clientv3.LeaseID(resp.ID)
		var answer error
		if resp.TTL <= 0 {
			answer = fmt.Errorf("renew lease %x: %w", resp.ID, rpctypes.ErrLeaseNotFound)
		}
		st.mu.Lock()
		if chs := st.waiting[id]; len(chs) > 0 {
			chs[0] <- answer
			st.waiting[id] = chs[1:]
			if len(chs) == 1 {
				delete(st.waiting, id)
			}
		}
		st.mu.Unlock()
	}
}
