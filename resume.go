package coord

import (
	"context"
	"sync"
)

// A term steps down when its session's renewals go unanswered (see
// keeper): etcd may be the one in trouble (a leader change, a cut shorter
// than the lease), and the lease may live on, with our key on it. Nobody
// else can hold while that key stands: those behind it wait for its
// delete, and a key is never created again with the same create revision.
// So a run of the same owner (a Campaign of the same Election, an Acquire
// of the same Semaphore) that is pending when etcd answers again takes the
// key back, and holds again with the same token, once etcd has confirmed
// both:
//   - a renewal sent after the step-down answered with TTL > 0: the lease
//     lived on (see keeper.answer; session.ready waits for it), and
//   - its put, which finds the key created at the token's revision and
//     writes it again on our lease in one transaction (see candidate):
//     at that revision our key stood, so nobody held in between.
// From there the run decides as any other (see look). Without a pending
// run, the key is deleted as soon as etcd answers.

// stepped follows an owner's terms, live or stepped down, whose keys a
// later run may take back.
type stepped struct {
	keep bool            // a ShardSet's election: keys wait for the next run, pending or not
	life context.Context // the owner's: once it ends, no run will come
	wg   *sync.WaitGroup // the owner's

	mu      sync.Mutex
	pending int                  // runs under way
	terms   map[*leadership]bool // live or stepped down, not yet settled; true once given up
	changed chan struct{}        // closed and replaced when pending or a give-up changes
}

func newStepped(life context.Context, wg *sync.WaitGroup) *stepped {
	return &stepped{life: life, wg: wg, terms: map[*leadership]bool{}, changed: make(chan struct{})}
}

// pokeLocked wakes the terms waiting for a change.
func (st *stepped) pokeLocked() {
	close(st.changed)
	st.changed = make(chan struct{})
}

// begin counts a run under way until the returned func is called.
func (st *stepped) begin() func() {
	st.mu.Lock()
	st.pending++
	st.mu.Unlock()
	return func() {
		st.mu.Lock()
		defer st.mu.Unlock()
		st.pending--
		st.pokeLocked()
	}
}

// track follows term l from its start.
func (st *stepped) track(l *leadership) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.terms[l] = false
}

// untrack forgets l: it is over with its key.
func (st *stepped) untrack(l *leadership) {
	st.mu.Lock()
	defer st.mu.Unlock()
	delete(st.terms, l)
}

// giveUp has the keys of the stepped-down terms (l's alone, if l is not
// nil) deleted as soon as etcd answers, rather than taken back: Resign,
// Release.
func (st *stepped) giveUp(l *leadership) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for t := range st.terms {
		if l == nil || t == l {
			st.terms[t] = true
		}
	}
	st.pokeLocked()
}

// adopt returns a term of session s that stepped down, for a run to take
// its key back; nil if there is none. Once adopted, the key is the run's.
func (st *stepped) adopt(s *session) *leadership {
	st.mu.Lock()
	defer st.mu.Unlock()
	for l, given := range st.terms {
		if l.sess == s && !given && l.up.Err() != nil {
			delete(st.terms, l)
			return l
		}
	}
	return nil
}

// settle takes care of the key of term l, which stepped down, on behalf of
// candidacy c: it waits until etcd answers l's session again, then leaves
// the key to a pending run (see adopt), or deletes it once none is
// pending. A session that ended takes the key with its lease. Once the
// owner's life ended, the key is deleted at once.
func (st *stepped) settle(c *candidacy, l *leadership) {
	s := l.sess
	for {
		for !s.valid() && s.ctx.Err() == nil && st.life.Err() == nil {
			select {
			case <-s.k.renewed():
			case <-s.ctx.Done():
			case <-st.life.Done():
			}
		}
		st.mu.Lock()
		given, ok := st.terms[l]
		switch {
		case !ok:
			st.mu.Unlock()
			return // taken back
		case s.ctx.Err() != nil:
			delete(st.terms, l)
			st.mu.Unlock()
			return
		case given || st.life.Err() != nil || st.pending == 0 && !st.keep:
			delete(st.terms, l)
			st.mu.Unlock()
			var err error
			<-c.release(l, l.ctx.Err(), "step-down", &err)
			return
		}
		changed := st.changed
		st.mu.Unlock()
		select {
		case <-changed:
		case <-s.ctx.Done():
		case <-st.life.Done():
		case <-s.k.upCtx().Done():
		}
	}
}
