/**
 * The graph a node with shoal's int4 kernel runs: the compiler's graph with every MatMulNBits the
 * kernel takes made a MatMulQ4 (NATIVE_KERNEL_DOMAIN) — the op type and domain only; inputs,
 * attributes and weights stay. Done in memory when a session is made, so that the shards on disk,
 * and the manifest hash that names the model to the mesh, are the compiler's on every node,
 * whether or not it has the kernel. Pure functions of the graph's bytes.
 */
import onnxProto from 'onnx-proto'
import { NATIVE_KERNEL_DOMAIN } from '../../../shards/contract.ts'
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
  const inputs = (node.input ?? []).filter(i => i !== '')
  if (inputs.length !== 3 || node.input?.length !== 3) return false
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

export interface Int4Swap {
  /** The graph to load: the input itself when nothing was swapped. */
  bytes: Uint8Array
  /** MatMulNBits nodes made MatMulQ4. */
  swapped: number
}

/** A serialised ModelProto with the kernel's products swapped (and its op domain imported). */
export function swapInt4Products (model: Uint8Array): Int4Swap {
  const m = onnx.ModelProto.decode(model)
  const swapped = m.graph === null || m.graph === undefined ? 0 : swapGraph(m.graph)
  if (swapped === 0) return { bytes: model, swapped }
  if (!m.opsetImport.some(o => o.domain === NATIVE_KERNEL_DOMAIN)) m.opsetImport.push(onnx.OperatorSetIdProto.create({ domain: NATIVE_KERNEL_DOMAIN, version: 1 }))
  return { bytes: onnx.ModelProto.encode(m).finish(), swapped }
}

/**
 * Whether a model's graphs hold products the kernel takes, from its manifest: int4 'ort-contrib'
 * shards of block 32 with int8 activations (absent: int8), as `shoal shard --quant int4` writes
 * them, every product a MatMulNBits the kernel takes. Shards compiled with
 * the kernel's op already (`quantization.kernel`) need no swap.
 */
export function int4KernelApplies (manifest: Pick<ShardManifest, 'quantization' | 'opSet'>): boolean {
  const q = manifest.quantization
  return manifest.opSet === 'ort-contrib' && q.kind === 'int4' && q.blockSize === Q4_BLOCK && (q.activations ?? 'int8') === 'int8' && q.kernel === undefined
}
