package coord

import (
	"context"
	"iter"
	"math/rand/v2"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The context and retry plumbing shared by the concepts.

// withCancelOn returns a context that ends with ctx or when other ends,
// whichever is first, and its cancel function (which also lets go of
// other).
func withCancelOn(ctx, other context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(other, cancel)
	return ctx, func() { stop(); cancel() }
}

// clientCtx returns ctx, also ended when the client is closed: the etcd
// client otherwise retries a call on a closed connection for seconds.
func clientCtx(ctx context.Context, cli *clientv3.Client) (context.Context, context.CancelFunc) {
	return withCancelOn(ctx, cli.Ctx())
}

// retry paces a retry loop: capped exponential backoff, jittered over the
// upper half of each step so that a fleet does not retry in lockstep.
type retry struct{ d time.Duration }

// next returns the delay before the next attempt.
func (r *retry) next() time.Duration {
	r.d = min(max(2*r.d, minBackoff), maxBackoff)
	return r.d/2 + rand.N(r.d/2+1)
}

// relistSpread is the span over which the members of a fleet whose
// watches broke at once list again (see relistPause).
const relistSpread = time.Second

// relistPause waits, before listing again after a watch broke, until etcd
// answers a read of key (one key: the cheapest read that waits for a
// leader), then for a share of relistSpread drawn at random. Watches break
// together across a fleet (etcd replaced or restored, its quorum lost for
// seconds: an etcd restart is not one, the client resumes the watches):
// without the pause every member would list the moment etcd answers
// again, all at once; with it, the listings are spread over relistSpread.
func relistPause(ctx context.Context, cli *clientv3.Client, key string) {
	_, _ = cli.Get(ctx, key)
	sleep(ctx, rand.N(relistSpread))
}

// sleep waits for d or until ctx ends, reporting whether it waited fully.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// within waits until c is closed or ctx ends, reporting whether c closed.
func within(ctx context.Context, c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	case <-ctx.Done():
		return false
	}
}

// responses yields the responses of watch wch until it closes or ctx (the
// watch's) ends, whichever comes first. etcd's client closes a watch's
// channel once its stream has taken the cancel in, and a stream whose
// resumption failed can leave one open for good (client v3.7.3: watches
// refused on resumption after an etcd restart, seen under emulation), so
// nothing of ours waits for the close alone.
func responses(ctx context.Context, wch clientv3.WatchChan) iter.Seq[clientv3.WatchResponse] {
	return func(yield func(clientv3.WatchResponse) bool) {
		for {
			select {
			case wr, ok := <-wch:
				if !ok || !yield(wr) {
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}
}

// listPrefix reads every key under prefix in pages of at most limit keys,
// the later pages at the first one's revision: etcd serves a big prefix
// without one response of every key (a read it holds its store for), and
// many members listing at once are served in turns. It returns the first
// page's response with the keys of every page. A revision compacted
// between pages fails the read with etcd's ErrCompacted.
func listPrefix(ctx context.Context, cli *clientv3.Client, prefix string, limit int64) (*clientv3.GetResponse, error) {
	end := clientv3.GetPrefixRangeEnd(prefix)
	first, err := cli.Get(ctx, prefix, clientv3.WithRange(end), clientv3.WithLimit(limit))
	if err != nil {
		return nil, err
	}
	for resp := first; resp.More; {
		key := string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
		if resp, err = cli.Get(ctx, key, clientv3.WithRange(end), clientv3.WithLimit(limit), clientv3.WithRev(first.Header.Revision)); err != nil {
			return nil, err
		}
		first.Kvs = append(first.Kvs, resp.Kvs...)
	}
	first.More, first.Count = false, int64(len(first.Kvs))
	return first, nil
}
