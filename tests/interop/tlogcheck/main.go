// Command tlogcheck verifies inference-ledger proofs, checkpoints and tiles with Go's own
// transparency-log code (golang.org/x/mod/sumdb/tlog and sumdb/note), independently of
// the Python implementation.
//
// Build offline, in GOPATH mode, from Debian packages golang-go and
// golang-golang-x-mod-dev:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode:$TMP go build -o $TMP/tlogcheck ./tests/interop/tlogcheck
//
// Usage:
//
//	tlogcheck < items.json
//	    Verify every inclusion proof (tlog.CheckRecord), consistency proof
//	    (tlog.CheckTree) and checkpoint (note.Open + a separate reading of the
//	    tlog-checkpoint body) in the JSON document on stdin. Prints one OK or FAIL line
//	    per item; exits 1 if any item fails.
//
//	tlogcheck tiles URL VERIFIERKEY ORIGIN
//	    Read a C2SP tlog-tiles log over HTTP: verify URL/checkpoint, recompute the root
//	    with tlog.TreeHash over tlog.TileHashReader, and prove and check the inclusion of
//	    every entry in the entry bundles (record hash = RFC 6962 leaf hash of the entry).
package main

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

const tileHeight = 8

type inclusionItem struct {
	Name     string      `json:"name"`
	LeafHash tlog.Hash   `json:"leaf_hash"`
	Index    int64       `json:"index"`
	Size     int64       `json:"size"`
	Proof    []tlog.Hash `json:"proof"`
	Root     tlog.Hash   `json:"root"`
}

type consistencyItem struct {
	Name    string      `json:"name"`
	OldSize int64       `json:"old_size"`
	NewSize int64       `json:"new_size"`
	Proof   []tlog.Hash `json:"proof"`
	OldRoot tlog.Hash   `json:"old_root"`
	NewRoot tlog.Hash   `json:"new_root"`
}

type checkpointItem struct {
	Name        string    `json:"name"`
	Note        string    `json:"note"`
	VerifierKey string    `json:"verifier_key"`
	Origin      string    `json:"origin"`
	Size        int64     `json:"size"`
	Root        tlog.Hash `json:"root"`
}

type items struct {
	Inclusion   []inclusionItem   `json:"inclusion"`
	Consistency []consistencyItem `json:"consistency"`
	Checkpoints []checkpointItem  `json:"checkpoints"`
}

// parseCheckpoint reads a tlog-checkpoint body: origin, decimal size without leading
// zeros, base64 root hash, then optional non-empty extension lines.
func parseCheckpoint(text, origin string) (tlog.Tree, error) {
	if !strings.HasSuffix(text, "\n") {
		return tlog.Tree{}, errors.New("checkpoint text does not end in a newline")
	}
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	if len(lines) < 3 {
		return tlog.Tree{}, errors.New("checkpoint has fewer than three lines")
	}
	for _, l := range lines {
		if l == "" {
			return tlog.Tree{}, errors.New("checkpoint has an empty line")
		}
	}
	if lines[0] != origin {
		return tlog.Tree{}, fmt.Errorf("checkpoint origin %q, want %q", lines[0], origin)
	}
	n, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil || n < 0 || lines[1] != strconv.FormatInt(n, 10) {
		return tlog.Tree{}, fmt.Errorf("malformed tree size %q", lines[1])
	}
	h, err := base64.StdEncoding.DecodeString(lines[2])
	if err != nil || len(h) != tlog.HashSize {
		return tlog.Tree{}, fmt.Errorf("malformed root hash %q", lines[2])
	}
	var tree tlog.Tree
	tree.N = n
	copy(tree.Hash[:], h)
	return tree, nil
}

func openCheckpoint(msg []byte, vkey, origin string) (tlog.Tree, error) {
	v, err := note.NewVerifier(vkey)
	if err != nil {
		return tlog.Tree{}, fmt.Errorf("verifier key: %w", err)
	}
	n, err := note.Open(msg, note.VerifierList(v))
	if err != nil {
		return tlog.Tree{}, fmt.Errorf("note.Open: %w", err)
	}
	return parseCheckpoint(n.Text, origin)
}

func checkItems(in io.Reader, out io.Writer) int {
	var doc items
	dec := json.NewDecoder(in)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		fmt.Fprintf(out, "FAIL input: %v\n", err)
		return 2
	}
	failed := 0
	report := func(kind, name string, err error) {
		if err != nil {
			failed++
			fmt.Fprintf(out, "FAIL %s %s: %v\n", kind, name, err)
		} else {
			fmt.Fprintf(out, "OK %s %s\n", kind, name)
		}
	}
	for _, it := range doc.Inclusion {
		report("inclusion", it.Name, tlog.CheckRecord(it.Proof, it.Size, it.Root, it.Index, it.LeafHash))
	}
	for _, it := range doc.Consistency {
		report("consistency", it.Name, tlog.CheckTree(it.Proof, it.NewSize, it.NewRoot, it.OldSize, it.OldRoot))
	}
	for _, it := range doc.Checkpoints {
		tree, err := openCheckpoint([]byte(it.Note), it.VerifierKey, it.Origin)
		if err == nil && (tree.N != it.Size || tree.Hash != it.Root) {
			err = fmt.Errorf("checkpoint says (%d, %v), expected (%d, %v)", tree.N, tree.Hash, it.Size, it.Root)
		}
		report("checkpoint", it.Name, err)
	}
	if failed > 0 {
		return 1
	}
	return 0
}

// c2spPath turns Go's tile path (tile/H/L/N[.p/W], tile/H/data/N) into the C2SP
// tlog-tiles path (tile/L/N[.p/W], tile/entries/N), which has no height element.
func c2spPath(t tlog.Tile) string {
	rest := strings.TrimPrefix(t.Path(), fmt.Sprintf("tile/%d/", t.H))
	if t.L == -1 {
		rest = "entries/" + strings.TrimPrefix(rest, "data/")
	}
	return "tile/" + rest
}

type httpTiles struct {
	base  string
	cache map[tlog.Tile][]byte
	gets  int
}

func (r *httpTiles) get(path string) ([]byte, error) {
	r.gets++
	resp, err := http.Get(r.base + "/" + path)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return io.ReadAll(resp.Body)
}

func (r *httpTiles) Height() int { return tileHeight }

func (r *httpTiles) ReadTiles(tiles []tlog.Tile) ([][]byte, error) {
	out := make([][]byte, len(tiles))
	for i, t := range tiles {
		if data, ok := r.cache[t]; ok {
			out[i] = data
			continue
		}
		data, err := r.get(c2spPath(t))
		if err != nil {
			return nil, err
		}
		if len(data) != t.W*tlog.HashSize {
			return nil, fmt.Errorf("%s: %d bytes, want %d", c2spPath(t), len(data), t.W*tlog.HashSize)
		}
		r.cache[t] = data
		out[i] = data
	}
	return out, nil
}

func (r *httpTiles) SaveTiles(tiles []tlog.Tile, data [][]byte) {}

// cachedHashes remembers hashes already returned by a TileHashReader. Those were
// authenticated against the checkpoint's tree hash when first read, so reusing them is
// safe, and it keeps proving every entry of a large log fast.
type cachedHashes struct {
	r tlog.HashReader
	m map[int64]tlog.Hash
}

func (c *cachedHashes) ReadHashes(indexes []int64) ([]tlog.Hash, error) {
	var missing []int64
	seen := map[int64]bool{}
	for _, x := range indexes {
		if _, ok := c.m[x]; !ok && !seen[x] {
			seen[x] = true
			missing = append(missing, x)
		}
	}
	if len(missing) > 0 {
		hashes, err := c.r.ReadHashes(missing)
		if err != nil {
			return nil, err
		}
		if len(hashes) != len(missing) {
			return nil, fmt.Errorf("ReadHashes returned %d hashes for %d", len(hashes), len(missing))
		}
		for i, x := range missing {
			c.m[x] = hashes[i]
		}
	}
	out := make([]tlog.Hash, len(indexes))
	for i, x := range indexes {
		out[i] = c.m[x]
	}
	return out, nil
}

func decodeBundle(data []byte) ([][]byte, error) {
	var entries [][]byte
	for len(data) > 0 {
		if len(data) < 2 {
			return nil, errors.New("entry bundle ends inside a length")
		}
		n := int(binary.BigEndian.Uint16(data))
		if len(data) < 2+n {
			return nil, errors.New("entry bundle ends inside an entry")
		}
		entries = append(entries, data[2:2+n])
		data = data[2+n:]
	}
	return entries, nil
}

func checkTiles(base, vkey, origin string, out io.Writer) error {
	tr := &httpTiles{base: strings.TrimSuffix(base, "/"), cache: map[tlog.Tile][]byte{}}
	msg, err := tr.get("checkpoint")
	if err != nil {
		return err
	}
	tree, err := openCheckpoint(msg, vkey, origin)
	if err != nil {
		return err
	}
	thr := &cachedHashes{r: tlog.TileHashReader(tree, tr), m: map[int64]tlog.Hash{}}
	th, err := tlog.TreeHash(tree.N, thr)
	if err != nil {
		return fmt.Errorf("TreeHash: %w", err)
	}
	if th != tree.Hash {
		return fmt.Errorf("TreeHash from tiles %v, checkpoint says %v", th, tree.Hash)
	}
	proved := int64(0)
	for n := int64(0); n*(1<<tileHeight) < tree.N; n++ {
		w := tree.N - n*(1<<tileHeight)
		if w > 1<<tileHeight {
			w = 1 << tileHeight
		}
		bundle := tlog.Tile{H: tileHeight, L: -1, N: n, W: int(w)}
		data, err := tr.get(c2spPath(bundle))
		if err != nil {
			return err
		}
		entries, err := decodeBundle(data)
		if err != nil {
			return fmt.Errorf("%s: %w", c2spPath(bundle), err)
		}
		if int64(len(entries)) != w {
			return fmt.Errorf("%s: %d entries, want %d", c2spPath(bundle), len(entries), w)
		}
		// Read (and so authenticate) every stored hash inside this bundle's level-0 tile
		// in one call; ProveRecord below then finds them in the cache.
		var inTile []int64
		for level := 0; level < tileHeight; level++ {
			for k := (n << tileHeight) >> level; k < (n<<tileHeight+w)>>level; k++ {
				inTile = append(inTile, tlog.StoredHashIndex(level, k))
			}
		}
		if _, err := thr.ReadHashes(inTile); err != nil {
			return fmt.Errorf("%s: %w", c2spPath(tlog.Tile{H: tileHeight, L: 0, N: n, W: int(w)}), err)
		}
		for j, entry := range entries {
			index := n*(1<<tileHeight) + int64(j)
			p, err := tlog.ProveRecord(tree.N, index, thr)
			if err != nil {
				return fmt.Errorf("ProveRecord(%d): %w", index, err)
			}
			if err := tlog.CheckRecord(p, tree.N, tree.Hash, index, tlog.RecordHash(entry)); err != nil {
				return fmt.Errorf("CheckRecord(%d): %w", index, err)
			}
			proved++
		}
	}
	if proved != tree.N {
		return fmt.Errorf("proved %d entries, tree has %d", proved, tree.N)
	}
	// Consistency of a few earlier sizes with the checkpoint, from the same tiles.
	for _, m := range []int64{1, tree.N / 3, tree.N / 2, tree.N - 1} {
		if m < 1 || m > tree.N {
			continue
		}
		old, err := tlog.TreeHash(m, thr)
		if err != nil {
			return fmt.Errorf("TreeHash(%d): %w", m, err)
		}
		p, err := tlog.ProveTree(tree.N, m, thr)
		if err != nil {
			return fmt.Errorf("ProveTree(%d, %d): %w", tree.N, m, err)
		}
		if err := tlog.CheckTree(p, tree.N, tree.Hash, m, old); err != nil {
			return fmt.Errorf("CheckTree(%d, %d): %w", tree.N, m, err)
		}
	}
	fmt.Fprintf(out, "OK tiles size=%d root=%v entries_proved=%d http_gets=%d\n", tree.N, tree.Hash, proved, tr.gets)
	return nil
}

func main() {
	if len(os.Args) == 1 {
		var buf bytes.Buffer
		code := checkItems(os.Stdin, &buf)
		os.Stdout.Write(buf.Bytes())
		os.Exit(code)
	}
	if len(os.Args) == 5 && os.Args[1] == "tiles" {
		if err := checkTiles(os.Args[2], os.Args[3], os.Args[4], os.Stdout); err != nil {
			fmt.Printf("FAIL tiles: %v\n", err)
			os.Exit(1)
		}
		return
	}
	fmt.Fprintln(os.Stderr, "usage: tlogcheck < items.json | tlogcheck tiles URL VERIFIERKEY ORIGIN")
	os.Exit(2)
}
