/**
 * A stage's one-position graph (StageManifest.decodeGraph: the stage graph with its one-position
 * Ifs inline, shards/graph/decode-graph.ts): it has no If, reads the stage graph's weights file,
 * and a runner that runs it for one-position steps over a past gives the stage graph's logits bit
 * for bit — alone over a chunked prefill and 40 decode steps, in batches of mixed lengths, after a
 * rollback, and for a one-token prompt (no past: the stage graph runs it). Plus the pure choice of
 * when a node loads it, and the manifest's checks on it.
 */
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import onnxProto from 'onnx-proto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { argmax, chooseStageGraphs, createOnnxruntimeBackend, createStageRunner, resolveGraphChoice, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BackendSession, PrefixKeepingRunner, StepOutput, TensorMap } from '../../daemon/engine/index.ts'
import { DECODE_GRAPH_MAX_WEIGHT_BYTES, decodeGraphWanted } from '../../daemon/engine/graph-choice.ts'
import { STAGE_DATA_FILE, STAGE_DECODE_GRAPH_FILE, validateManifest } from '../../shards/index.ts'
import { inlineDecodeBranches } from '../../shards/graph/decode-graph.ts'
import { logitsOf } from './greedy-batches.ts'
import { buildTinyModel } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

const ids = (n: number, salt: number): bigint[] => Array.from({ length: n }, (_, i) => BigInt((i * 37 + salt * 101 + 5) % 500))
const positions = (from: number, n: number): BigInt64Array => BigInt64Array.from({ length: n }, (_, i) => BigInt(from + i))
/** The engine's own greedy rule over the last position's logits. */
const argmaxOf = (o: StepOutput): number => { const l = logitsOf(o); const vocab = (o as { vocab: number }).vocab; return argmax(l, l.length - vocab, vocab) }
const bitsOf = (a: Float32Array): Uint32Array => new Uint32Array(a.buffer, a.byteOffset, a.length)

describe.each(['llama', 'qwen3'] as const)('the one-position graph (%s)', (architecture) => {
  let model: TinyModel
  let plain: PrefixKeepingRunner
  let split: PrefixKeepingRunner
  const decodeRuns: number[] = []
  const mainRuns: number[] = []
  const sessions: BackendSession[] = []

  beforeAll(async () => {
    model = await buildTinyModel(architecture)
    const stage = model.manifest.stages[0]!
    expect(stage.decodeGraph).toBe(`${stage.dir}/${STAGE_DECODE_GRAPH_FILE}`)
    const backend = createOnnxruntimeBackend()
    const count = (s: BackendSession, runs: number[]): BackendSession => ({ ...s, async run (feeds, fetches): Promise<TensorMap> { runs.push(feeds.position_ids!.dims[1]!); return await s.run(feeds, fetches) } })
    const main = await backend.load(model.graphPath, { device: 'CPU', threads: 1 })
    const decode = await backend.load(join(model.shardDir, ...stage.decodeGraph!.split('/')), { device: 'CPU', threads: 1 })
    const reference = await backend.load(model.graphPath, { device: 'CPU', threads: 1 })
    sessions.push(main, decode, reference)
    const info = stageInfoOf(model.manifest)
    plain = createStageRunner({ session: reference, stage: info, chunkSize: 8 })
    split = createStageRunner({ session: count(main, mainRuns), decodeSession: count(decode, decodeRuns), stage: info, chunkSize: 8 })
  })
  afterAll(async () => {
    for (const s of sessions) await s.close()
    await model?.cleanup()
  })

  it('has no If, and reads the stage graph\'s weights file', async () => {
    const stage = model.manifest.stages[0]!
    const graph = onnxProto.onnx.ModelProto.decode(await readFile(join(model.shardDir, ...stage.decodeGraph!.split('/')))).graph!
    const full = onnxProto.onnx.ModelProto.decode(await readFile(model.graphPath)).graph!
    expect(full.node!.filter(n => n.opType === 'If')).toHaveLength(model.manifest.shape.numLayers)
    expect(graph.node!.filter(n => n.opType === 'If')).toHaveLength(0)
    expect(graph.input!.map(i => i.name)).toEqual(full.input!.map(i => i.name))
    expect(graph.output!.map(o => o.name)).toEqual(full.output!.map(o => o.name))
    const locations = new Set(graph.initializer!.flatMap(t => (t.externalData ?? []).filter(e => e.key === 'location').map(e => e.value)))
    expect([...locations]).toEqual([STAGE_DATA_FILE])
    expect(() => inlineDecodeBranches(graph)).toThrow(/no one-position If/)
  })

  it('gives the stage graph\'s logits bit for bit, alone and in batches of mixed lengths, and runs only one-position steps over a past', async () => {
    /** Greedy continuation of each prompt on `runner`, all rows stepping together; every step's logits. */
    async function run (runner: PrefixKeepingRunner, tag: string, prompts: bigint[][], steps: number): Promise<Float32Array[]> {
      const out: Float32Array[] = []
      const last: number[] = []
      for (const [i, p] of prompts.entries()) {
        runner.open(`${tag}${i}`)
        const o = await runner.step(`${tag}${i}`, { kind: 'tokens', ids: BigInt64Array.from(p) }, positions(0, p.length), 1)
        out.push(logitsOf(o))
        last.push(argmaxOf(o))
      }
      for (let k = 0; k < steps; k++) {
        const inputs = [...last]
        const rs = await runner.stepBatch(prompts.map((p, i) => ({ seqId: `${tag}${i}`, input: { kind: 'tokens', ids: BigInt64Array.of(BigInt(inputs[i]!)) }, positions: positions(p.length + k, 1), logitsToKeep: 1 })))
        rs.forEach((r, i) => {
          if ('error' in r) throw r.error
          out.push(logitsOf(r.output))
          last[i] = argmaxOf(r.output)
        })
        // Halfway, the first row takes back its last position (a speculative round's rollback) and steps it again.
        if (k === steps / 2) {
          const length = prompts[0]!.length + k + 1
          runner.rollback(`${tag}0`, length - 1)
          out.push(logitsOf(await runner.step(`${tag}0`, { kind: 'tokens', ids: BigInt64Array.of(BigInt(inputs[0]!)) }, positions(length - 1, 1), 1)))
        }
      }
      for (const i of prompts.keys()) await runner.drop(`${tag}${i}`, 'free')
      return out
    }
    for (const [label, prompts, steps] of [['alone', [ids(30, 1)], 40], ['batched', [ids(3, 2), ids(9, 3), ids(17, 4), ids(1, 5)], 24]] as const) {
      mainRuns.length = 0
      decodeRuns.length = 0
      const want = await run(plain, `p-${label}-`, prompts.map(p => [...p]), steps)
      const got = await run(split, `s-${label}-`, prompts.map(p => [...p]), steps)
      expect(got.length).toBe(want.length)
      got.forEach((g, i) => { expect(bitsOf(g), `${label}: logits ${i}`).toEqual(bitsOf(want[i]!)) })
      // Prefill chunks, and the one-token prompt's first step (one position, no past), ran the stage
      // graph; every one-position step over a past ran the one-position graph.
      expect(mainRuns.filter(s => s === 1)).toHaveLength(label === 'batched' ? 1 : 0)
      expect(decodeRuns.every(s => s === 1)).toBe(true)
      expect(decodeRuns.length).toBeGreaterThanOrEqual(steps)
    }
  })
})

describe('when a node runs the one-position graph', () => {
  let model: TinyModel
  beforeAll(async () => { model = await buildTinyModel('llama') })
  afterAll(async () => { await model?.cleanup() })

  it('onnxruntime, weights up to the bound: yes; another backend, bigger weights, static graphs or none compiled: no', () => {
    const m = model.manifest
    const stage = m.stages[0]!
    expect(decodeGraphWanted(stage, 'onnxruntime')).toBe(true)
    expect(decodeGraphWanted(stage, 'openvino')).toBe(false)
    const weighing = (bytes: number): typeof stage => ({ ...stage, files: stage.files.map(f => f.path.endsWith(STAGE_DATA_FILE) ? { ...f, bytes } : f) })
    expect(decodeGraphWanted(weighing(DECODE_GRAPH_MAX_WEIGHT_BYTES), 'onnxruntime')).toBe(true)
    expect(decodeGraphWanted(weighing(DECODE_GRAPH_MAX_WEIGHT_BYTES + 1), 'onnxruntime')).toBe(false)
    const { decodeGraph: _, ...without } = stage
    expect(decodeGraphWanted(without, 'onnxruntime')).toBe(false)
    const choice = chooseStageGraphs(m, 0, 'CPU')
    expect(choice).toEqual({ kind: 'dynamic', graph: stage.graph, decodeGraph: stage.decodeGraph })
    expect(resolveGraphChoice(model.shardDir, choice).decodeGraphPath).toBe(join(model.shardDir, ...stage.decodeGraph!.split('/')))
    expect(chooseStageGraphs(m, 0, 'CPU', 'auto', 'openvino')).toEqual({ kind: 'dynamic', graph: stage.graph })
  })

  it('the manifest names it among the stage\'s files, in \'ort-contrib\' shards only', () => {
    const m = model.manifest
    const stage = m.stages[0]!
    expect(() => validateManifest(m)).not.toThrow()
    expect(() => validateManifest({ ...m, stages: [{ ...stage, files: stage.files.filter(f => f.path !== stage.decodeGraph) }] })).toThrow(/decodeGraph/)
    expect(() => validateManifest({ ...m, stages: [{ ...stage, decodeGraph: 42 as unknown as string }] })).toThrow(/decodeGraph/)
    expect(() => validateManifest({ ...m, opSet: 'standard' })).toThrow(/ort-contrib/)
  })
})
