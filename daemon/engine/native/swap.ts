/**
 * The graph a node with shoal's kernels runs: the compiler's graph with every MatMulNBits the int4
 * kernel takes made a MatMulQ4 (NATIVE_KERNEL_DOMAIN) — the op type and domain only; inputs,
 * attributes and weights stay — every one-position attention block made one DecodeAttention
 * node, the graph the compiler writes for its 'native' form, and verify steps (every position's
 * logits kept) given VerifyAttention, each position as a one-position step; where the loader
 * asks, an f32 head's greedy token made GreedyHead and the f32 layer products MatMulF32 (the same
 * bits as onnxruntime's). Done in memory when a session is made, so that the shards on disk, and the manifest hash that names the model to the mesh, are
 * the compiler's on every node, whether or not it has the kernels. Pure functions of the graph's
 * bytes and the manifest.
 */
import onnxProto from 'onnx-proto'
import { NATIVE_KERNEL_DOMAIN, NUM_LOGITS_TO_KEEP } from '../../../shards/contract.ts'
import type { ShardManifest } from '../../../shards/contract.ts'
import { MS_DOMAIN } from '../../../shards/graph/builder.ts'

const { onnx } = onnxProto
type INodeProto = onnxProto.onnx.INodeProto
type IGraphProto = onnxProto.onnx.IGraphProto

/** The kernel's one block size: q4-matmul.h Q4_BLOCK. */
const Q4_BLOCK = 32
/** MatMulNBits' accuracy level 4: activations quantised to int8 per block, as the kernel does. */
const INT8_ACTIVATIONS = 4

/** An int attribute's value (protobufjs decodes int64 as a Long where long.js is installed). */
function intAttr (node: INodeProto, name: string): number | undefined {
  const a = node.attribute?.find(x => x.name === name)
  if (a?.i === undefined || a.i === null) return undefined
  return typeof a.i === 'number' ? a.i : Number(a.i.toString())
}

/**
 * Whether the kernel computes this node: a com.microsoft MatMulNBits of 4-bit weights in blocks of
 * 32 at accuracy level 4, with A, B and scales only (no zero points, group index or bias). The
 * kernel ends the process on any other shape (a custom op of its ABI has no error return), so
 * nothing else is swapped.
 */
export function takesQ4Kernel (node: INodeProto): boolean {
  if (node.opType !== 'MatMulNBits' || node.domain !== MS_DOMAIN) return false
  if (node.input?.length !== 3 || node.input.includes('')) return false
  const K = intAttr(node, 'K')
  const N = intAttr(node, 'N')
  return intAttr(node, 'bits') === 4 && intAttr(node, 'block_size') === Q4_BLOCK && intAttr(node, 'accuracy_level') === INT8_ACTIVATIONS &&
    K !== undefined && K > 0 && K % Q4_BLOCK === 0 && N !== undefined && N > 0
}

/** Swaps in place, subgraphs (If branches) included; how many nodes. */
function swapGraph (graph: IGraphProto): number {
  let swapped = 0
  for (const node of graph.node ?? []) {
    if (takesQ4Kernel(node)) {
      node.opType = 'MatMulQ4'
      node.domain = NATIVE_KERNEL_DOMAIN
      swapped++
    }
    for (const a of node.attribute ?? []) {
      if (a.g !== undefined && a.g !== null) swapped += swapGraph(a.g)
      for (const g of a.graphs ?? []) swapped += swapGraph(g)
    }
  }
  return swapped
}

/** The compiler's dense layer products (shards/graph/blocks.ts makeLinear): the ones MatMulF32 takes. */
const LAYER_PRODUCT = /^\/model\/layers\.\d+\/(attn\/(qkv_proj|o_proj)|mlp\/(gate_up_proj|down_proj))\/MatMul$/

/**
 * Every f32 layer product the compiler writes (a MatMul of the layer's activations and an f32
 * [K, N] weight of the main graph's initializers) made a MatMulF32 (ort-kernels.c, f32-matmul.h):
 * the op type and domain only. Other MatMuls (the attention's, a router's, an expert's) stay.
 * Returns how many.
 */
function swapF32Products (main: IGraphProto): number {
  const weights = new Map((main.initializer ?? []).map(t => [t.name ?? '', t]))
  let swapped = 0
  for (const node of main.node ?? []) {
    if (node.opType !== 'MatMul' || (node.domain ?? '') !== '' || !LAYER_PRODUCT.test(node.name ?? '') || node.input?.length !== 2) continue
    const w = weights.get(node.input[1] ?? '')
    if (w?.dataType !== onnx.TensorProto.DataType.FLOAT || w.dims?.length !== 2) continue
    node.opType = 'MatMulF32'
    node.domain = NATIVE_KERNEL_DOMAIN
    swapped++
  }
  return swapped
}

/** A graph's nodes by name, and where each sits. */
function byName (graph: IGraphProto): Map<string, INodeProto> {
  return new Map((graph.node ?? []).map(n => [n.name ?? '', n]))
}

/** Every graph of the model: the main one, then the If branches, depth first. */
function allGraphs (graph: IGraphProto): IGraphProto[] {
  const out = [graph]
  for (const node of graph.node ?? []) {
    for (const a of node.attribute ?? []) {
      if (a.g !== undefined && a.g !== null) out.push(...allGraphs(a.g))
      for (const g of a.graphs ?? []) out.push(...allGraphs(g))
    }
  }
  return out
}

/** An int64 initializer's values, searched in every graph (the compiler's small constants). */
function int64s (graphs: IGraphProto[], name: string): number[] | undefined {
  for (const g of graphs) {
    const t = g.initializer?.find(x => x.name === name)
    if (t === undefined) continue
    if (t.dataType !== onnx.TensorProto.DataType.INT64) return undefined
    if (t.rawData !== undefined && t.rawData !== null && t.rawData.length > 0) {
      const raw = Uint8Array.from(t.rawData)
      return [...new BigInt64Array(raw.buffer, 0, raw.length / 8)].map(Number)
    }
    return (t.int64Data ?? []).map(v => typeof v === 'number' ? v : Number(v.toString()))
  }
  return undefined
}

/** The kernel's lanes: it takes head dimensions that are a multiple of 16 (ort-kernels.c). */
const ATTENTION_LANES = 16

/**
 * Every one-position attention block the compiler wrote in its 'per-head' or 'grouped' form
 * (shards/graph/attention.ts decodeAttentionNodes: nodes named `…/decode/…`, their context out of
 * `…/decode/context/Reshape`) made one DecodeAttention node of the kernel, with the inputs the
 * compiler gives its 'native' form: the rotated query, the new key and value, the past buffers
 * and each row's seqlens_k. The new key's and value's Reshapes (graph outputs) stay; the block's
 * other nodes go, and so do the shared mask tables they alone read. A block whose shape the kernel
 * does not take, or that does not read as the compiler writes it, stays. Returns how many.
 */
function swapAttention (main: IGraphProto): number {
  const graphs = allGraphs(main)
  const lengths = graphs.map(g => byName(g).get('/model/decode/lengths/Cast')).find(n => n !== undefined)
  const seqlensK = lengths?.input?.[0]
  if (seqlensK === undefined || seqlensK === null) return 0
  let swapped = 0
  for (const graph of graphs) {
    const nodes = byName(graph)
    for (const ctx of [...graph.node ?? []]) {
      const name = ctx.name ?? ''
      if (ctx.opType !== 'Reshape' || !name.endsWith('/decode/context/Reshape')) continue
      const m = name.slice(0, -'/context/Reshape'.length)
      const q = nodes.get(`${m}/q/Mul`)?.input?.[0]
      const kReshape = nodes.get(`${m}/k/Reshape`)
      const vReshape = nodes.get(`${m}/v/Reshape`)
      // per-head: Unsqueeze, then Transpose; grouped: Transpose of the buffer itself.
      const pastK = (nodes.get(`${m}/past_k/Unsqueeze`) ?? nodes.get(`${m}/past_k/Transpose`))?.input?.[0]
      const pastV = nodes.get(`${m}/past_v/Unsqueeze`)?.input?.[0] ?? nodes.get(`${m}/num/MatMul`)?.input?.[1]
      const kShape = int64s(graphs, kReshape?.input?.[1] ?? '') // [0, kvH, 1, hd]
      const ctxShape = int64s(graphs, ctx.input?.[1] ?? '') // [0, 1, H·hd]
      const out = ctx.output?.[0]
      if (q == null || kReshape === undefined || vReshape === undefined || pastK == null || pastV == null || kShape?.length !== 4 || ctxShape?.length !== 3 || out == null) continue
      const [kvH, hd] = [kShape[1]!, kShape[3]!]
      const H = ctxShape[2]! / hd
      if (hd % ATTENTION_LANES !== 0 || !Number.isInteger(H) || H % kvH !== 0) continue
      const attention = onnx.NodeProto.create({
        name: `${m}/DecodeAttention`,
        opType: 'DecodeAttention',
        domain: NATIVE_KERNEL_DOMAIN,
        input: [q, kReshape.input![0]!, vReshape.input![0]!, pastK, pastV, seqlensK],
        output: [out],
        attribute: [
          onnx.AttributeProto.create({ name: 'num_heads', type: onnx.AttributeProto.AttributeType.INT, i: H }),
          onnx.AttributeProto.create({ name: 'kv_num_heads', type: onnx.AttributeProto.AttributeType.INT, i: kvH }),
        ],
      })
      // In the context Reshape's place: every input is made before it.
      graph.node = (graph.node ?? []).flatMap(n => n === ctx ? [attention] : (n.name ?? '').startsWith(`${m}/`) && n !== kReshape && n !== vReshape ? [] : [n])
      swapped++
    }
  }
  if (swapped > 0) dropUnread(graphs, '/model/decode/')
  return swapped
}

/** Nodes named under `prefix` whose outputs nothing reads (a node of any graph, or a graph output), until none is left. */
function dropUnread (graphs: IGraphProto[], prefix: string): void {
  for (;;) {
    const read = new Set<string>()
    for (const g of graphs) {
      for (const n of g.node ?? []) for (const i of n.input ?? []) read.add(i)
      for (const o of g.output ?? []) read.add(o.name ?? '')
    }
    let dropped = false
    for (const g of graphs) {
      const kept = (g.node ?? []).filter(n => !(n.name ?? '').startsWith(prefix) || (n.output ?? []).some(o => read.has(o)))
      if (kept.length !== (g.node ?? []).length) { g.node = kept; dropped = true }
    }
    if (!dropped) return
  }
}

/**
 * Speculative verify steps on the kernel: in every layer's `…/decode/If` whose one-position branch
 * runs DecodeAttention (after swapAttention, or as compiled in the 'native' form), the other
 * branch (GroupQueryAttention, for steps of several positions) becomes an If of its own: a step
 * that keeps every position's logits (a verify of K drafts: K + 1 positions, K + 1 kept) runs the
 * one-position branch's nodes with VerifyAttention in DecodeAttention's place (the query, key and
 * value split and rotated as one-position steps do; the new key and value columns [B, S, kvH·hd]
 * as [B, kvH, S, hd]), so each position gets the bits a one-position step at it would (ort-kernels.c,
 * VerifyAttention) and a verified draft is the token plain decoding gives. Prefill (one kept
 * position) stays on GroupQueryAttention, whose bits do not depend on how a prompt is chunked and
 * whose long prompts it runs faster (VerifyAttention took 1.4–1.6× its time at 2,000 tokens).
 * A graph without a head (a chain's earlier stage) has no num_logits_to_keep of its own: it gets
 * the input (takeLogitsToKeep), read by the condition alone, and the engine feeds it as to a last
 * stage (the positions a step wants: all of them for a chain's verify), so every stage of a chain
 * verifies as it decodes. Returns how many layers.
 */
function swapSteps (main: IGraphProto): number {
  const graphs = allGraphs(main)
  const stepLength = byName(main).get('/model/decode/S/Shape')?.output?.[0]
  if (stepLength == null) return 0
  const keep = NUM_LOGITS_TO_KEEP
  let swapped = 0
  const initializers = main.initializer ?? []
  main.initializer = initializers
  main.node = (main.node ?? []).flatMap(node => {
    const name = node.name ?? ''
    const then = node.attribute?.find(a => a.name === 'then_branch')?.g
    const otherwise = node.attribute?.find(a => a.name === 'else_branch')
    if (node.opType !== 'If' || !name.endsWith('/decode/If') || then == null || otherwise?.g == null) return [node]
    const inner = then.node ?? []
    const attention = inner.find(n => n.opType === 'DecodeAttention' && n.domain === NATIVE_KERNEL_DOMAIN)
    const outs = (then.output ?? []).map(o => o.name ?? '')
    const kReshape = inner.find(n => n.opType === 'Reshape' && n.output?.[0] === outs[1])
    const vReshape = inner.find(n => n.opType === 'Reshape' && n.output?.[0] === outs[2])
    if (attention === undefined || outs.length !== 3 || attention.output?.[0] !== outs[0] || kReshape === undefined || vReshape === undefined) return [node]
    const kvH = intAttr(attention, 'kv_num_heads')
    const kShape = int64s(graphs, kReshape.input?.[1] ?? '') // [0, kvH, 1, hd]
    if (kvH === undefined || kShape?.length !== 4) return [node]
    const m = name.slice(0, -'/If'.length)
    // The one-position branch's nodes again, their values renamed: names are unique model-wide.
    const made = new Set(inner.flatMap(n => n.output ?? []))
    const renamed = (v: string): string => made.has(v) ? `${v}/verify` : v
    const copy = (n: INodeProto, extra: Partial<INodeProto> = {}): INodeProto =>
      onnx.NodeProto.create({ ...n, name: `${n.name ?? ''}/verify`, input: (n.input ?? []).map(renamed), output: (n.output ?? []).map(renamed), ...extra })
    const shapeName = `${m}/verify/kv_shape`
    initializers.push(onnx.TensorProto.create({ name: shapeName, dataType: onnx.TensorProto.DataType.INT64, dims: [4], int64Data: [0, -1, kvH, kShape[3]!] }))
    const columns = (kind: 'k' | 'v', of: string): INodeProto[] => [
      onnx.NodeProto.create({ name: `${m}/verify/${kind}/Reshape`, opType: 'Reshape', input: [renamed(of), shapeName], output: [`${m}/verify/${kind}/heads`] }),
      onnx.NodeProto.create({
        name: `${m}/verify/${kind}/Transpose`, opType: 'Transpose', input: [`${m}/verify/${kind}/heads`], output: [`${m}/verify/${kind}/columns`],
        attribute: [onnx.AttributeProto.create({ name: 'perm', type: onnx.AttributeProto.AttributeType.INTS, ints: [0, 2, 1, 3] })],
      }),
    ]
    const verify = onnx.GraphProto.create({
      name: `${m}/verify`,
      node: [
        ...inner.filter(n => n !== attention && n !== kReshape && n !== vReshape).map(n => copy(n)),
        copy(attention, { name: `${m}/verify/VerifyAttention`, opType: 'VerifyAttention', output: [`${m}/verify/context`] }),
        ...columns('k', kReshape.input![0]!),
        ...columns('v', vReshape.input![0]!),
      ],
      output: [`${m}/verify/context`, `${m}/verify/k/columns`, `${m}/verify/v/columns`].map((o, i) => onnx.ValueInfoProto.create({ name: o, type: then.output![i]!.type })),
    })
    const longer = otherwise.g
    const branchOuts = (longer.output ?? []).map((_, i) => `${m}/steps/If:${i}`)
    const cond = onnx.NodeProto.create({ name: `${m}/verify/cond/Equal`, opType: 'Equal', input: [keep, stepLength], output: [`${m}/verify/cond`] })
    const steps = onnx.NodeProto.create({
      name: `${m}/steps/If`, opType: 'If', input: [`${m}/verify/cond`], output: branchOuts,
      attribute: [
        onnx.AttributeProto.create({ name: 'then_branch', type: onnx.AttributeProto.AttributeType.GRAPH, g: verify }),
        onnx.AttributeProto.create({ name: 'else_branch', type: onnx.AttributeProto.AttributeType.GRAPH, g: longer }),
      ],
    })
    otherwise.g = onnx.GraphProto.create({
      name: longer.name ?? `${m}/else`,
      node: [steps],
      output: branchOuts.map((o, i) => onnx.ValueInfoProto.create({ name: o, type: longer.output![i]!.type })),
    })
    swapped++
    return [cond, node]
  })
  return swapped
}

/**
 * A headless graph (a chain's earlier stage) given num_logits_to_keep as an input, for swapSteps'
 * condition: its one-position graph (decode.onnx) gets it too, unread, so the stage's two graphs
 * keep the same inputs (stage-runner.ts checks) and take the same feeds.
 */
function takeLogitsToKeep (main: IGraphProto): void {
  if (main.input?.some(i => i.name === NUM_LOGITS_TO_KEEP) === true) return
  main.input = [...main.input ?? [], onnx.ValueInfoProto.create({
    name: NUM_LOGITS_TO_KEEP,
    type: onnx.TypeProto.create({ tensorType: onnx.TypeProto.Tensor.create({ elemType: onnx.TensorProto.DataType.INT64, shape: onnx.TensorShapeProto.create({ dim: [] }) }) }),
  })]
}

/**
 * The input a head swapped by swapHead reads (a bool scalar): false, a run gives the greedy token
 * alone (its logits output empty) without the head's product; true, what the compiler's graph
 * gives. onnxruntime-node feeds only a graph's inputs proper (an initializer's default cannot be
 * overridden through it), so it is an input, and the backend that loads the graph feeds it on
 * every run (onnxruntime.ts).
 */
export const LOGITS_WANTED = 'shoal_logits_wanted'

/** The widest head GreedyHead takes: its exact int32 sums of K·63·127 (ort-kernels.c checks it too). */
const GREEDY_HEAD_MAX_K = 65536

/**
 * An f32 head's greedy token on the kernel (GreedyHead, greedy-head.h): where the compiler wrote
 * the head as a Gemm (transB, an initializer's weights) whose logits feed the in-graph greedy TopK
 * (shards/graph/blocks.ts makeLmHead, stage.ts), the Gemm, the logits' Reshape and the TopK become
 * the then-branch of an If on LOGITS_WANTED, and the else-branch is one GreedyHead over the normed rows and
 * the same weights: the token TopK gives, bit for bit (the exact sums MLAS's), with logits
 * [B, K, 0]. A run that fetches the greedy token alone feeds false (onnxruntime.ts): at eight rows
 * of 250m f32 the Gemm and TopK took ~7.5 ms of a ~43 ms step, the screen and the exact sums ~4.
 * Returns 1 when swapped.
 */
function swapHead (main: IGraphProto): number {
  const nodes = byName(main)
  const gemm = nodes.get('/lm_head/Gemm')
  const reshape = nodes.get('/lm_head/Reshape')
  const topk = nodes.get('/model/greedy/TopK')
  const flat = nodes.get('/lm_head/flat/Reshape')
  const weight = gemm?.input?.[1]
  const kept = flat?.input?.[0]
  if (gemm === undefined || reshape === undefined || topk === undefined || flat === undefined || weight == null || kept == null) return 0
  if (gemm.input?.length !== 2 || intAttr(gemm, 'transB') !== 1 || (intAttr(gemm, 'transA') ?? 0) !== 0) return 0
  if (gemm.attribute?.some(a => (a.name === 'alpha' || a.name === 'beta') && a.f !== 1) === true) return 0
  const w = main.initializer?.find(t => t.name === weight)
  // The kernel's 32-bit sums hold K up to 65,536 columns (greedy-head.h).
  if (w?.dataType !== onnx.TensorProto.DataType.FLOAT || w.dims?.length !== 2 || Number(w.dims[1]) > GREEDY_HEAD_MAX_K) return 0
  if (reshape.input?.[0] !== gemm.output?.[0] || topk.input?.[0] !== reshape.output?.[0]) return 0
  const logits = reshape.output?.[0]
  const token = topk.output?.[1]
  if (logits == null || token == null) return 0
  // Only the logits and the token leave the branch: nothing else may read the Gemm's or TopK's values.
  const inside = new Set<string>([gemm.output?.[0] ?? '', topk.output?.[0] ?? ''])
  const readers = allGraphs(main).flatMap(g => [...(g.node ?? []).filter(n => n !== reshape && n !== topk).flatMap(n => n.input ?? []), ...(g.output ?? []).map(o => o.name ?? '')])
  if (readers.some(v => v !== '' && inside.has(v))) return 0
  const type = (elemType: number): onnxProto.onnx.ITypeProto => onnx.TypeProto.create({ tensorType: onnx.TypeProto.Tensor.create({ elemType }) })
  const F32 = onnx.TensorProto.DataType.FLOAT
  const I64 = onnx.TensorProto.DataType.INT64
  // The branch's values renamed: names are unique model-wide, and the If's outputs take the old ones.
  const inner = new Set([gemm, reshape, topk].flatMap(n => n.output ?? []))
  const renamed = (v: string): string => inner.has(v) ? `${v}/full` : v
  const full = onnx.GraphProto.create({
    name: '/lm_head/full',
    node: [gemm, reshape, topk].map(n => onnx.NodeProto.create({ ...n, input: (n.input ?? []).map(renamed), output: (n.output ?? []).map(renamed) })),
    output: [onnx.ValueInfoProto.create({ name: renamed(logits), type: type(F32) }), onnx.ValueInfoProto.create({ name: renamed(token), type: type(I64) })],
  })
  const greedy = onnx.GraphProto.create({
    name: '/lm_head/greedy',
    node: [onnx.NodeProto.create({ name: '/lm_head/GreedyHead', opType: 'GreedyHead', domain: NATIVE_KERNEL_DOMAIN, input: [kept, weight], output: ['/lm_head/greedy/logits', '/lm_head/greedy/token'] })],
    output: [onnx.ValueInfoProto.create({ name: '/lm_head/greedy/logits', type: type(F32) }), onnx.ValueInfoProto.create({ name: '/lm_head/greedy/token', type: type(I64) })],
  })
  const branch = onnx.NodeProto.create({
    name: '/lm_head/If', opType: 'If', input: [LOGITS_WANTED], output: [logits, token],
    attribute: [
      onnx.AttributeProto.create({ name: 'then_branch', type: onnx.AttributeProto.AttributeType.GRAPH, g: full }),
      onnx.AttributeProto.create({ name: 'else_branch', type: onnx.AttributeProto.AttributeType.GRAPH, g: greedy }),
    ],
  })
  // In the TopK's place: every input (the normed rows, the logits' shape) is made before it.
  main.node = (main.node ?? []).flatMap(n => n === topk ? [branch] : n === gemm || n === reshape ? [] : [n])
  // The logits' declared shape ends in the vocabulary; a greedy run's are empty.
  for (const o of main.output ?? []) {
    if (o.name === logits) o.type = type(F32)
  }
  main.input = [...main.input ?? [], onnx.ValueInfoProto.create({ name: LOGITS_WANTED, type: onnx.TypeProto.create({ tensorType: onnx.TypeProto.Tensor.create({ elemType: onnx.TensorProto.DataType.BOOL, shape: onnx.TensorShapeProto.create({ dim: [] }) }) }) })]
  return 1
}

export interface KernelSwap {
  /** The graph to load: the input itself when nothing was swapped. */
  bytes: Uint8Array
  /** MatMulNBits nodes made MatMulQ4. */
  int4: number
  /** One-position attention blocks made DecodeAttention. */
  attention: number
  /** Layers whose verify steps (every position kept) run VerifyAttention (swapSteps). */
  steps: number
  /** Heads whose greedy token runs on GreedyHead when the logits are not fetched (swapHead): 0 or 1. */
  head: number
  /** f32 layer products made MatMulF32 (swapF32Products). */
  f32: number
}

/**
 * A serialised ModelProto with the kernels' ops swapped in (and their op domain imported): the
 * int4 products the kernel takes, and the one-position attention blocks; with `head`, an f32
 * head's greedy token too (swapHead), for a loader that feeds LOGITS_WANTED on every run; with
 * `f32`, the f32 layer products (swapF32Products), for a loader whose CPU and library the kernel
 * suits (native/build.ts f32KernelFits, f32-check.ts).
 */
export function swapKernels (model: Uint8Array, options: { head?: boolean, f32?: boolean } = {}): KernelSwap {
  const m = onnx.ModelProto.decode(model)
  if (m.graph === null || m.graph === undefined) return { bytes: model, int4: 0, attention: 0, steps: 0, head: 0, f32: 0 }
  const int4 = swapGraph(m.graph)
  const attention = swapAttention(m.graph)
  const steps = swapSteps(m.graph)
  const head = options.head === true ? swapHead(m.graph) : 0
  const f32 = options.f32 === true ? swapF32Products(m.graph) : 0
  if (int4 + attention + steps + head + f32 === 0) return { bytes: model, int4, attention, steps, head, f32 }
  if (attention + steps > 0) takeLogitsToKeep(m.graph)
  if (!m.opsetImport.some(o => o.domain === NATIVE_KERNEL_DOMAIN)) m.opsetImport.push(onnx.OperatorSetIdProto.create({ domain: NATIVE_KERNEL_DOMAIN, version: 1 }))
  return { bytes: onnx.ModelProto.encode(m).finish(), int4, attention, steps, head, f32 }
}

/**
 * Whether a model's graphs hold products the kernel takes, from its manifest: int4 'ort-contrib'
 * shards of block 32 with int8 activations (absent: int8), as `shoal shard --quant int4` writes
 * them, every product a MatMulNBits the kernel takes. Shards compiled with
 * the kernel's op already (`quantization.kernel`) need no swap.
 */
export function int4KernelApplies (manifest: Pick<ShardManifest, 'quantization' | 'opSet'>): boolean {
  return manifest.opSet === 'ort-contrib' && int4ProductsTakeKernel(manifest.quantization)
}

/**
 * Whether graphs quantized so write their products as MatMulNBits nodes the kernel takes: int4,
 * block 32, int8 activations, not compiled with the kernel's op already. Expert-parallel shards
 * (standard ops, MatMulNBits for every quantized linear) are judged by this alone.
 */
export function int4ProductsTakeKernel (q: ShardManifest['quantization']): boolean {
  return q.kind === 'int4' && q.blockSize === Q4_BLOCK && (q.activations ?? 'int8') === 'int8' && q.kernel === undefined
}

/**
 * Whether a model's one-position attention can run on the kernel, from its manifest: 'ort-contrib'
 * shards (their one-position steps attend over the past in place, shards/graph/attention.ts) in
 * the 'per-head' or 'grouped' form, of a head dimension the kernel takes.
 */
export function attentionKernelApplies (manifest: Pick<ShardManifest, 'opSet' | 'decodeAttention' | 'shape'>): boolean {
  return manifest.opSet === 'ort-contrib' && manifest.decodeAttention !== 'native' && manifest.shape.headDim % ATTENTION_LANES === 0
}

/**
 * Whether a model's verify steps run on the kernel (swapSteps), a chain's stages' as a whole
 * model's: the attention kernel applies and the compiler wrote the one-position branch it
 * replaces (a decode form in the manifest).
 */
function verifyKernelApplies (manifest: Pick<ShardManifest, 'opSet' | 'decodeAttention' | 'shape'>): boolean {
  return attentionKernelApplies(manifest) && manifest.decodeAttention !== undefined
}

/**
 * Which of shoal's kernels a model's graphs run where the library is loaded (as capabilities name
 * them): a whole model's, or any stage's of a chain.
 */
export function kernelsApplying (manifest: Pick<ShardManifest, 'opSet' | 'decodeAttention' | 'shape' | 'quantization'>): Array<'int4' | 'attention' | 'verify'> {
  return [
    ...int4KernelApplies(manifest) ? ['int4' as const] : [],
    ...attentionKernelApplies(manifest) ? ['attention' as const] : [],
    ...verifyKernelApplies(manifest) ? ['verify' as const] : [],
  ]
}
