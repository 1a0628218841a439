/**
 * Does a verify step (several positions in one run) pick the same greedy tokens as one-position
 * decoding? Decodes N tokens of a prompt one position at a time on a whole-model shard directory,
 * then feeds the same tokens back in steps of S positions (S = 2..6, at three alignments) and
 * reports every position whose argmax differs, with the one-position logits' top-2 margin. On int8-
 * activation shards the answer can be no (why speculation refuses them); prints the smallest margin
 * seen, since a run without near-ties cannot show a flip. The engine runs as a node runs it:
 * on shoal's kernels where they build here (whose verify steps give one-position bits: none should
 * differ), or `--kernels onnxruntime` for onnxruntime's own ops.
 *
 * Run: node reproduction/check-verify-rounding.ts SHARD_DIR [--tokens 64] [--prompt TEXT] [--kernels auto|onnxruntime]
 */
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { argmax, createStageEngine, stageInfoOf } from '../daemon/engine/index.ts'
import { loadTextCodec } from '../daemon/text/index.ts'
import { loadManifest } from '../shards/index.ts'
import { nodeKernels } from './lib/native-kernels.ts'

const { values: args, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    tokens: { type: 'string', default: '64' },
    prompt: { type: 'string', default: 'The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived' },
    kernels: { type: 'string', default: 'auto' },
  },
})
const dir = positionals[0]
if (dir === undefined) throw new Error('usage: check-verify-rounding.ts SHARD_DIR')
const N = Number(args.tokens)
const manifest = await loadManifest(dir)
const lib = args.kernels === 'onnxruntime' ? {} : await nodeKernels(manifest)
const engine = createStageEngine({ graphPath: join(dir, ...manifest.stages[0]!.graph.split('/')), stage: stageInfoOf(manifest), threads: 2, ...lib })
await engine.start()
const prompt = (await loadTextCodec(dir, manifest)).encodePrompt({ kind: 'text', text: args.prompt })
const margin = (d: Float32Array, off: number, V: number): number => {
  const b = argmax(d, off, V)
  let second = -Infinity
  for (let i = 0; i < V; i++) if (i !== b && d[off + i]! > second) second = d[off + i]!
  return d[off + b]! - second
}

const seq = await engine.open()
let out = await engine.step(seq, { tokenIds: prompt }, prompt.map((_, i) => i), { logitsToKeep: 1 })
const tokens: number[] = []
const margins: number[] = []
for (let i = 0; i < N; i++) {
  if (out.kind !== 'logits') throw new Error('no logits')
  const off = (out.count - 1) * out.vocab
  tokens.push(argmax(out.data, off, out.vocab))
  margins.push(margin(out.data, off, out.vocab))
  out = await engine.step(seq, { tokenIds: [tokens[i]!] }, [prompt.length + i], { logitsToKeep: 1 })
}
await engine.free(seq)

let total = 0
for (const S of [2, 3, 4, 5, 6]) {
  for (const shift of [0, 1, 2]) {
    const v = await engine.open()
    await engine.step(v, { tokenIds: prompt }, prompt.map((_, i) => i), { logitsToKeep: 1 })
    // The first `shift` tokens one position a step, as decoding ran them.
    for (let j = 0; j < shift; j++) await engine.step(v, { tokenIds: [tokens[j]!] }, [prompt.length + j], { logitsToKeep: 1 })
    let mismatches = 0
    for (let i = shift; i + S <= N; i += S) {
      const ids = tokens.slice(i, i + S)
      const o = await engine.step(v, { tokenIds: ids }, ids.map((_, j) => prompt.length + i + j), { logitsToKeep: S })
      if (o.kind !== 'logits') throw new Error('no logits')
      for (let j = 0; j < S && i + j + 1 < N; j++) {
        const t = argmax(o.data, j * o.vocab, o.vocab)
        if (t !== tokens[i + j + 1]) {
          mismatches++
          process.stdout.write(`S=${S} alignment ${shift}: position ${i + j + 1} verify picks ${t}, one-position decoding ${tokens[i + j + 1]} (margin ${margins[i + j + 1]!.toExponential(2)})\n`)
        }
      }
    }
    total += mismatches
    await engine.free(v)
  }
}
process.stdout.write(`${dir}: quantization ${JSON.stringify(manifest.quantization)}, ${lib.kernels === undefined ? "onnxruntime's kernels" : "shoal's kernels"}; ${total} differing positions; smallest top-2 margin ${Math.min(...margins).toExponential(2)}\n`)
await engine.stop()
