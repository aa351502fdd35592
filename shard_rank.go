package coord

import (
	"math"
	"slices"
)

// How a shard's members rank: functions of the members alone, without
// etcd or a lock, that rank alike on every member (wire format); and the
// rankings a ShardSet keeps with them.

// ranking is the shards' rankings, kept as the live members change (see
// refreshLocked). Guarded by ShardSet.mu.
type ranking struct {
	order     map[string][]rankedMember // by shard, the members that take part, best first
	zoned     bool                      // whether the rankings' members are in more than one zone
	ranked    map[string]bool           // by shard, whether we are among its candidates
	ordered   map[string]ShardMember    // the members the rankings hold, by HostUUID
	selfLive  bool                      // whether we were a live member at the last refresh
	refreshed bool                      // whether a refresh has reconciled every shard
}

// weight is host's rendezvous weight for shard: FNV-1a 64 of shard, a
// zero byte and host, spread by splitmix64's finalizer (FNV alone leaves
// weights of similar names close together). The zero byte keeps ("ab",
// "c") apart from ("a", "bc"). It is wire format, as RankHosts is: it
// must never change.
func weight(shard, host string) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for _, s := range [...]string{shard, "\x00", host} {
		for i := 0; i < len(s); i++ {
			h = (h ^ uint64(s[i])) * prime
		}
	}
	h = (h ^ h>>30) * 0xbf58476d1ce4e5b9
	h = (h ^ h>>27) * 0x94d049bb133111eb
	return h ^ h>>31
}

// RankHosts returns hosts (HostUUIDs) in the order every ShardSet ranks
// them for shard, best first: by rendezvous weight, the highest first,
// then by HostUUID. The top Replicas live hosts campaign for the shard and
// the first of them that campaigns owns it, so any program can tell where
// a shard belongs without asking etcd. hosts is not changed.
//
// The ranking is wire format, shared by every agent of a fleet whatever
// its version: it must never change. Were it to, old and new agents would
// rank differently during a rolling upgrade: more than Replicas hosts
// might campaign for a shard, or none of them.
func RankHosts(shard string, hosts []string) []string {
	out := slices.Clone(hosts)
	slices.SortFunc(out, func(a, b string) int {
		if ranksBefore(shard, a, b) {
			return -1
		}
		return 1
	})
	return out
}

// ranksBefore reports whether host a ranks before host b for shard: by
// weight, highest first, then by HostUUID. Every host ranks alike.
func ranksBefore(shard, a, b string) bool {
	return heavier(weight(shard, a), a, weight(shard, b), b)
}

// heavier reports whether host a, of rendezvous weight wa, ranks before
// host b, of weight wb: the higher weight first, then the lower HostUUID.
func heavier(wa uint64, a string, wb uint64, b string) bool {
	return wa > wb || wa == wb && a < b
}

// rankedMember is a member as a shard ranks it: with its rendezvous
// weight and score for the shard, computed once. It points to the member,
// which every shard's ranking shares: a fleet's rankings are shards ×
// members of these, kept small.
type rankedMember struct {
	*ShardMember
	w     uint64  // weight(shard, HostUUID)
	score float64 // see score
}

// rankOn returns m as shard ranks it.
func rankOn(shard string, m *ShardMember) rankedMember {
	w := weight(shard, m.HostUUID)
	return rankedMember{m, w, score(m.Weight, w)}
}

// member returns m: what pickRanked picks from.
func (m ShardMember) member() ShardMember { return m }

// score is the weighted rendezvous score of a member of weight weight
// whose rendezvous weight is w: −weight/ln(h), h being w mapped into
// (0, 1). A member of weight 2 scores highest about twice as often as one
// of weight 1.
func score(weight float64, w uint64) float64 {
	h := (float64(w>>11) + 0.5) / (1 << 53)
	return -weight / math.Log(h)
}

// before reports whether a ranks before b for their shard: draining
// members last; then by weighted score, the highest first; then as
// RankHosts ranks (which is the order of the scores when the weights are
// equal, without their rounding).
func (a rankedMember) before(b rankedMember) bool {
	if a.Draining != b.Draining {
		return b.Draining
	}
	if a.Weight != b.Weight && a.score != b.score {
		return a.score > b.score
	}
	return heavier(a.w, a.HostUUID, b.w, b.HostUUID)
}

// byRank orders members of one shard, best first; no two are equal (they
// are distinct hosts).
func byRank(a, b rankedMember) int {
	if a.before(b) {
		return -1
	}
	return 1
}

// memberBefore reports whether member a ranks before member b for shard.
func memberBefore(shard string, a, b ShardMember) bool {
	return rankOn(shard, &a).before(rankOn(shard, &b))
}

// RankMembers returns members in the order every ShardSet ranks them for
// shard, best first: draining members last; then by weighted rendezvous
// score, the highest first; then as RankHosts ranks (for members of one
// weight that do not drain, the order of RankHosts). A candidate in line
// behind a shard's owner that ranks before it is a planned move: the
// owner hands the shard over. members is not changed.
//
// Like RankHosts, the ranking is wire format: it must never change.
func RankMembers(shard string, members []ShardMember) []ShardMember {
	ranked := make([]rankedMember, len(members))
	for i, m := range members {
		ranked[i] = rankOn(shard, &m)
	}
	slices.SortFunc(ranked, byRank)
	out := make([]ShardMember, len(ranked))
	for i, m := range ranked {
		out[i] = *m.ShardMember
	}
	return out
}

// pickRanked returns the candidates among ranked, best first: the
// best-ranked member of each zone, in rank order, until there are n; then
// the best-ranked others. So a shard's n candidates are in n zones while
// there are that many.
func pickRanked[M interface{ member() ShardMember }](ranked []M, n int) []M {
	out := make([]M, 0, n)
	zones := map[string]bool{}
	var rest []M
	for _, m := range ranked {
		if z := m.member().Zone; len(out) < n && !zones[z] {
			zones[z] = true
			out = append(out, m)
		} else if len(rest) < n {
			rest = append(rest, m)
		}
	}
	return append(out, rest[:min(len(rest), n-len(out))]...)
}
