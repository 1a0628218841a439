/**
 * The kernel swap (daemon/engine/native/swap.ts), pure: what a node with shoal's kernels makes of
 * the compiler's graphs in memory — the int4 products MatMulQ4, the one-position attention
 * DecodeAttention, verify steps VerifyAttention, an f32 shard's layer products MatMulF32 when asked —
 * and which shards it applies to. No compiler needed; the kernels built and run in a node are
 * native-kernels.test.ts's.
 */
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import onnxProto from 'onnx-proto'
import { describe, expect, it } from 'vitest'
import { attentionKernelApplies, int4KernelApplies, kernelsApplying, swapKernels } from '../../daemon/engine/index.ts'
import { NATIVE_KERNEL_DOMAIN } from '../../shards/contract.ts'
import type { ShardManifest } from '../../shards/contract.ts'
import { DT, GraphBuilder, MS_DOMAIN } from '../../shards/graph/builder.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'

const { onnx } = onnxProto
/** A graph of MatMulNBits nodes: the ones the kernel takes and the ones it does not, one inside an If. */
function productsGraph (): Uint8Array {
  const g = new GraphBuilder('g.onnx.data')
  const x = g.input('x', DT.FLOAT, ['m', 64])
  const w = g.weight('w', DT.UINT8, [8, 2, 16], new Uint8Array(256))
  const s = g.weight('s', DT.FLOAT, [16], new Uint8Array(64))
  const attrs = { K: 64, N: 8, bits: 4, block_size: 32, accuracy_level: 4 }
  const taken = g.op('MatMulNBits', '/taken', [x, w, s], attrs, MS_DOMAIN)
  const f32 = g.op('MatMulNBits', '/f32-activations', [x, w, s], { ...attrs, accuracy_level: 0 }, MS_DOMAIN)
  const block16 = g.op('MatMulNBits', '/block-16', [x, w, s], { ...attrs, block_size: 16 }, MS_DOMAIN)
  const zeros = g.op('MatMulNBits', '/zero-points', [x, w, s, s], attrs, MS_DOMAIN)
  const sub = new GraphBuilder('g.onnx.data')
  sub.output('y', sub.op('MatMulNBits', '/branch', [x, w, s], attrs, MS_DOMAIN), DT.FLOAT, ['m', 8])
  const cond = g.input('cond', DT.BOOL, [])
  const branch = g.op('If', '/if', [cond], { then_branch: { graph: { name: 'then', node: sub.nodes, output: sub.outputs } }, else_branch: { graph: { name: 'else', node: sub.nodes, output: sub.outputs } } })
  for (const [i, y] of [taken, f32, block16, zeros, branch].entries()) g.output(`y${i}`, y, DT.FLOAT, ['m', 8])
  return g.encode('g', 'products')
}

describe('the kernel swap (daemon/engine/native/swap.ts)', () => {
  it('makes MatMulQ4 of the products the kernel takes, in If branches too, and of nothing else', () => {
    const { bytes, int4: swapped, attention } = swapKernels(productsGraph())
    expect(swapped).toBe(3)
    expect(attention).toBe(0)
    const m = onnx.ModelProto.decode(bytes)
    const ops = m.graph!.node!.map(n => `${n.domain}::${n.opType}`)
    expect(ops).toContain(`${NATIVE_KERNEL_DOMAIN}::MatMulQ4`)
    expect(ops.filter(o => o === `${MS_DOMAIN}::MatMulNBits`)).toHaveLength(3) // f32 activations, block 16, zero points
    const iff = m.graph!.node!.find(n => n.opType === 'If')!
    for (const a of iff.attribute!) expect(a.g!.node!.map(n => n.opType)).toEqual(['MatMulQ4'])
    expect(m.opsetImport.filter(o => o.domain === NATIVE_KERNEL_DOMAIN)).toHaveLength(1)
    // The inputs and attributes stay the compiler's.
    const taken = m.graph!.node!.find(n => n.name === '/taken')!
    expect(taken.input).toEqual(['x', 'w', 's'])
    expect(taken.attribute!.map(a => a.name)).toEqual(['K', 'N', 'bits', 'block_size', 'accuracy_level'])
    // Swapped twice: nothing more to swap.
    expect(swapKernels(bytes)).toEqual({ bytes, int4: 0, attention: 0, steps: 0, head: 0, f32: 0 })
  })

  it('leaves a graph without such products byte for byte', () => {
    const g = new GraphBuilder('g.onnx.data')
    g.output('y', g.op('Relu', '/relu', [g.input('x', DT.FLOAT, [4])]), DT.FLOAT, [4])
    const bytes = g.encode('g', 'no products')
    expect(swapKernels(bytes)).toEqual({ bytes, int4: 0, attention: 0, steps: 0, head: 0, f32: 0 })
  })

  it('makes every one-position attention block of a compiled graph one DecodeAttention node, either form, and drops what only they read; verify steps VerifyAttention', async () => {
    const root = await mkdtemp(join(tmpdir(), 'shoal-attention-swap-'))
    try {
      await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'tiny' })
      for (const form of ['per-head', 'grouped'] as const) {
        const m = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, form), decodeAttention: form })
        expect(attentionKernelApplies(m)).toBe(true)
        const { bytes, int4, attention } = swapKernels(await readFile(join(root, form, ...m.stages[0]!.decodeGraph!.split('/'))))
        expect([int4, attention]).toEqual([0, m.shape.numLayers])
        const nodes = onnx.ModelProto.decode(bytes).graph!.node!
        expect(nodes.filter(n => n.opType === 'DecodeAttention' && n.domain === NATIVE_KERNEL_DOMAIN)).toHaveLength(m.shape.numLayers)
        // The new key and value still leave as outputs; the block's other nodes and the mask tables are gone.
        expect(nodes.filter(n => /\/decode\/[kv]\/Reshape$/.test(n.name!))).toHaveLength(2 * m.shape.numLayers)
        expect(nodes.filter(n => /\/decode\/(past|num|sum|context|top)\//.test(n.name!) || n.name!.startsWith('/model/decode/'))).toEqual([])
        const first = nodes.find(n => n.opType === 'DecodeAttention')!
        expect(first.attribute!.map(a => [a.name, Number(a.i)])).toEqual([['num_heads', m.shape.numHeads], ['kv_num_heads', m.shape.numKvHeads]])
        // It reads the past buffers themselves, and every input is made before it.
        expect(first.input!.slice(3, 5)).toEqual(['past_key_values.0.key', 'past_key_values.0.value'])
        const made = new Set(onnx.ModelProto.decode(bytes).graph!.input!.map(i => i.name!))
        for (const i of onnx.ModelProto.decode(bytes).graph!.initializer!) made.add(i.name!)
        for (const n of nodes) {
          for (const i of n.input!) if (i !== '') expect(made.has(i), `${n.name} reads ${i}`).toBe(true)
          for (const o of n.output!) made.add(o)
        }
        // The graph of every step length: in each layer's If, steps of several positions that keep
        // every position's logits (verify steps) run VerifyAttention; other such steps keep
        // GroupQueryAttention.
        const full = swapKernels(await readFile(join(root, form, ...m.stages[0]!.graph.split('/'))))
        expect([full.int4, full.attention, full.steps]).toEqual([0, m.shape.numLayers, m.shape.numLayers])
        const g = onnx.ModelProto.decode(full.bytes).graph!
        const every = (graph: typeof g): Array<typeof g> => [graph, ...graph.node!.flatMap(n => n.attribute!.flatMap(a => a.g == null ? [] : every(a.g)))]
        const ops = every(g).flatMap(x => x.node!.map(n => n.opType))
        for (const op of ['VerifyAttention', 'DecodeAttention', 'GroupQueryAttention']) expect(ops.filter(o => o === op), op).toHaveLength(m.shape.numLayers)
        expect(g.node!.filter(n => n.name!.endsWith('/verify/cond/Equal')).map(n => n.input![0])).toEqual(new Array(m.shape.numLayers).fill('num_logits_to_keep'))
        // Every value a branch reads is made before it, in it or in a graph around it, once.
        const outputs = every(g).flatMap(x => x.node!.flatMap(n => n.output!))
        expect(new Set(outputs).size).toBe(outputs.length)
        const known = new Set([...g.input!.map(i => i.name!), ...g.initializer!.map(i => i.name!)])
        const check = (graph: typeof g, scope: Set<string>): void => {
          const here = new Set(scope)
          for (const n of graph.node!) {
            for (const i of n.input!) if (i !== '') expect(here.has(i), `${n.name} reads ${i}`).toBe(true)
            for (const a of n.attribute!) if (a.g != null) check(a.g, here)
            for (const o of n.output!) here.add(o)
          }
          for (const o of graph.output!) expect(here.has(o.name!), `${graph.name} outputs ${o.name}`).toBe(true)
        }
        check(g, known)
      }
    } finally {
      await rm(root, { recursive: true, force: true })
    }
  })

  it('makes MatMulF32 of an f32 shard\'s layer products when asked, of nothing else', async () => {
    const root = await mkdtemp(join(tmpdir(), 'shoal-f32-swap-'))
    try {
      await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'tiny' })
      const m = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), decodeAttention: 'grouped' })
      const graph = await readFile(join(root, 'shard', ...m.stages[0]!.graph.split('/')))
      expect(swapKernels(graph).f32).toBe(0)
      const { bytes, f32 } = swapKernels(graph, { f32: true })
      // q/k/v, o, gate/up and down of every layer.
      expect(f32).toBe(4 * m.shape.numLayers)
      const g = onnx.ModelProto.decode(bytes).graph!
      const weights = new Set(g.initializer!.map(t => t.name!))
      const swapped = g.node!.filter(n => n.opType === 'MatMulF32')
      expect(swapped.every(n => n.domain === NATIVE_KERNEL_DOMAIN && weights.has(n.input![1]!) && /\/(qkv_proj|o_proj|gate_up_proj|down_proj)\/MatMul$/.test(n.name!))).toBe(true)
      // Beside the other swaps, only the products' op type and domain change: the same nodes, in the same order, on the same inputs.
      const before = onnx.ModelProto.decode(swapKernels(graph).bytes).graph!.node!
      expect(g.node!.map(n => [n.name, n.input])).toEqual(before.map(n => [n.name, n.input]))
      expect(before.filter(n => swapped.some(x => x.name === n.name)).every(n => n.opType === 'MatMul' && (n.domain ?? '') === '')).toBe(true)
      // An int4 shard has no f32 layer products to take.
      const q = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'int4'), quant: 'int4' })
      expect(swapKernels(await readFile(join(root, 'int4', ...q.stages[0]!.graph.split('/'))), { f32: true }).f32).toBe(0)
    } finally {
      await rm(root, { recursive: true, force: true })
    }
  })

  it('applies to int4 ort-contrib shards of block 32 with int8 activations, as compiled by default', () => {
    const q = { kind: 'int4', blockSize: 32, activations: 'int8' } as const
    const m = (over: Partial<ShardManifest>): Pick<ShardManifest, 'quantization' | 'opSet'> => ({ opSet: 'ort-contrib', quantization: q, ...over })
    expect(int4KernelApplies(m({}))).toBe(true)
    // Before compiler 3 int8 activations went unrecorded.
    expect(int4KernelApplies(m({ quantization: { kind: 'int4', blockSize: 32 } }))).toBe(true)
    for (const other of [
      m({ opSet: 'standard' }),
      m({ quantization: { kind: 'none' } }),
      m({ quantization: { ...q, kind: 'int8' } }),
      m({ quantization: { ...q, blockSize: 128 } }),
      m({ quantization: { ...q, activations: 'f32' } }),
      m({ quantization: { ...q, kernel: 'native' } }),
    ]) expect(int4KernelApplies(other), JSON.stringify(other)).toBe(false)
    // The attention kernel: 'ort-contrib' shards of a head dimension of 16 lanes, in a form the swap reads.
    const shape = { headDim: 64 } as ShardManifest['shape']
    expect(attentionKernelApplies({ opSet: 'ort-contrib', shape })).toBe(true)
    expect(attentionKernelApplies({ opSet: 'ort-contrib', shape, decodeAttention: 'grouped' })).toBe(true)
    expect(attentionKernelApplies({ opSet: 'standard', shape })).toBe(false)
    expect(attentionKernelApplies({ opSet: 'ort-contrib', shape: { headDim: 24 } as ShardManifest['shape'] })).toBe(false)
    expect(attentionKernelApplies({ opSet: 'ort-contrib', shape, decodeAttention: 'native' })).toBe(false)
    // Verify steps: models (whole, or any stage of a chain) whose manifest has the one-position
    // form the swap extends.
    const full = { ...m({}), shape, decodeAttention: 'grouped' } as const
    expect(kernelsApplying(full)).toEqual(['int4', 'attention', 'verify'])
    expect(kernelsApplying({ ...full, decodeAttention: undefined })).toEqual(['int4', 'attention'])
  })
})
