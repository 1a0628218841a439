/**
 * A small ONNX graph writer over `onnx-proto`: nodes with hierarchical names, small constants
 * inline, weights as external data appended to one data file per graph (loaded by path).
 */
import onnxProto from 'onnx-proto'

const { onnx } = onnxProto
type INodeProto = onnxProto.onnx.INodeProto
type ITensorProto = onnxProto.onnx.ITensorProto
type IValueInfoProto = onnxProto.onnx.IValueInfoProto
type IAttributeProto = onnxProto.onnx.IAttributeProto
type IGraphProto = onnxProto.onnx.IGraphProto

/** ONNX TensorProto.DataType values used here. */
export const DT = { FLOAT: 1, UINT8: 2, INT8: 3, INT32: 6, INT64: 7, BOOL: 9 } as const
export type ElemType = typeof DT[keyof typeof DT]

export const MS_DOMAIN = 'com.microsoft'
export const IR_VERSION = 8
export const OPSET = 17

export type AttrValue = number | number[] | string | { float: number } | { floats: number[] } | { graph: IGraphProto }
export type Dim = number | string

/** Large tensors start on a page boundary so a runtime may mmap them. */
const PAGE = 4096
const SMALL = 64

export class GraphBuilder {
  readonly nodes: INodeProto[] = []
  /** Where node() appends: the graph's nodes, or an If branch's while it is being built. */
  private sink: INodeProto[] = this.nodes
  readonly initializers: ITensorProto[] = []
  readonly inputs: IValueInfoProto[] = []
  readonly outputs: IValueInfoProto[] = []
  readonly dataFile: string
  private readonly chunks: Uint8Array[] = []
  private dataBytes = 0
  private readonly constCache = new Map<string, string>()
  private readonly names = new Set<string>()
  usesMsDomain = false
  /** Op domains other than ONNX's and com.microsoft that some node uses (each imported at version 1). */
  readonly otherDomains = new Set<string>()

  constructor (dataFile: string) {
    this.dataFile = dataFile
  }

  /** Adds one node named `name` (e.g. /model/layers.3/attn/q_proj/MatMul); returns its output names. */
  node (opType: string, name: string, inputs: string[], attrs: Record<string, AttrValue> = {}, outputCount = 1, domain = ''): string[] {
    if (this.names.has(name)) throw new Error(`duplicate node name ${name}`)
    this.names.add(name)
    if (domain === MS_DOMAIN) this.usesMsDomain = true
    else if (domain !== '') this.otherDomains.add(domain)
    const outputs = Array.from({ length: outputCount }, (_, i) => `${name}/output_${i}`)
    this.sink.push({ name, opType, domain, input: inputs, output: outputs, attribute: Object.entries(attrs).map(([k, v]) => attr(k, v)) })
    return outputs
  }

  /**
   * An ONNX If node: `thenBranch` / `elseBranch` add their nodes (with this builder's node/op,
   * which append to the branch while it is built; weights and constants stay in the outer graph,
   * which a branch may read) and return their outputs, the same count and element types in both.
   * Returns the If's outputs.
   */
  ifNode (name: string, cond: string, types: ElemType[], thenBranch: () => string[], elseBranch: () => string[]): string[] {
    const branch = (label: string, build: () => string[]): IGraphProto => {
      const outer = this.sink
      const nodes: INodeProto[] = []
      this.sink = nodes
      let outs: string[]
      try { outs = build() } finally { this.sink = outer }
      if (outs.length !== types.length) throw new Error(`${name}: the ${label} branch returns ${outs.length} outputs, not ${types.length}`)
      return { name: `${name}/${label}`, node: nodes, output: outs.map((o, i) => ({ name: o, type: { tensorType: { elemType: types[i]! } } })) }
    }
    const thenGraph = branch('then', thenBranch)
    const elseGraph = branch('else', elseBranch)
    return this.node('If', name, [cond], { then_branch: { graph: thenGraph }, else_branch: { graph: elseGraph } }, types.length)
  }

  /** Single-output shorthand. */
  op (opType: string, name: string, inputs: string[], attrs: Record<string, AttrValue> = {}, domain = ''): string {
    return this.node(opType, name, inputs, attrs, 1, domain)[0]!
  }

  /** A weight stored in the external data file. */
  weight (name: string, elemType: ElemType, dims: number[], bytes: Uint8Array): string {
    const align = bytes.byteLength >= PAGE ? PAGE : SMALL
    const pad = (align - (this.dataBytes % align)) % align
    if (pad > 0) { this.chunks.push(new Uint8Array(pad)); this.dataBytes += pad }
    const offset = this.dataBytes
    this.chunks.push(bytes)
    this.dataBytes += bytes.byteLength
    this.initializers.push({
      name,
      dataType: elemType,
      dims,
      dataLocation: onnx.TensorProto.DataLocation.EXTERNAL,
      externalData: [
        { key: 'location', value: this.dataFile },
        { key: 'offset', value: String(offset) },
        { key: 'length', value: String(bytes.byteLength) },
      ],
    })
    return name
  }

  f32Weight (name: string, dims: number[], data: Float32Array): string {
    return this.weight(name, DT.FLOAT, dims, new Uint8Array(data.buffer, data.byteOffset, data.byteLength))
  }

  /** A small inline constant, shared between all uses of the same value. */
  constant (elemType: typeof DT.INT64 | typeof DT.INT32 | typeof DT.FLOAT | typeof DT.UINT8, dims: number[], values: number[]): string {
    const key = `${elemType}:${dims.join(',')}:${values.join(',')}`
    const hit = this.constCache.get(key)
    if (hit !== undefined) return hit
    const name = `/model/constants/${elemType === DT.INT64 ? 'INT64' : elemType === DT.INT32 ? 'INT32' : elemType === DT.UINT8 ? 'UINT8' : 'FLOAT'}_${this.constCache.size}`
    const raw = elemType === DT.INT64
      ? new Uint8Array(BigInt64Array.from(values.map(v => BigInt(v))).buffer)
      : elemType === DT.INT32 ? new Uint8Array(Int32Array.from(values).buffer)
        : elemType === DT.UINT8 ? Uint8Array.from(values) : new Uint8Array(Float32Array.from(values).buffer)
    this.initializers.push({ name, dataType: elemType, dims, rawData: raw })
    this.constCache.set(key, name)
    return name
  }

  i64 (values: number[], dims: number[] = [values.length]): string {
    return this.constant(DT.INT64, dims, values)
  }

  f32 (value: number): string {
    return this.constant(DT.FLOAT, [], [value])
  }

  input (name: string, elemType: ElemType, dims: Dim[]): string {
    this.inputs.push(valueInfo(name, elemType, dims))
    return name
  }

  /**
   * Declares `from` as graph output `name`: the producing node's output is renamed (an Identity
   * would copy the tensor every run — for present KV, the whole cache), falling back to an
   * Identity when `from` is not a node output (a graph input or initializer) or already an output.
   */
  output (name: string, from: string, elemType: ElemType, dims: Dim[]): void {
    const producer = this.nodes.find(n => n.output?.includes(from))
    if (from !== name && (producer === undefined || this.outputs.some(o => o.name === from))) {
      this.nodes.push({ name: `/model/outputs/${name}/Identity`, opType: 'Identity', domain: '', input: [from], output: [name] })
    } else if (from !== name) {
      producer!.output = producer!.output!.map(o => (o === from ? name : o))
      for (const n of this.nodes) n.input = n.input?.map(i => (i === from ? name : i)) ?? []
    }
    this.outputs.push(valueInfo(name, elemType, dims))
  }

  /** The external data file's bytes. */
  data (): Uint8Array[] {
    return this.chunks
  }

  get dataSize (): number {
    return this.dataBytes
  }

  /** Serialised ModelProto; `derive` may rewrite the graph first (decode-graph.ts: the same initializers, another graph). */
  encode (graphName: string, docString: string, derive: (graph: IGraphProto) => IGraphProto = g => g): Uint8Array {
    const opsetImport = [{ domain: '', version: OPSET }]
    if (this.usesMsDomain) opsetImport.push({ domain: MS_DOMAIN, version: 1 })
    for (const domain of this.otherDomains) opsetImport.push({ domain, version: 1 })
    return onnx.ModelProto.encode({
      irVersion: IR_VERSION,
      opsetImport,
      producerName: 'shoal',
      producerVersion: '1',
      docString,
      graph: derive({ name: graphName, node: this.nodes, initializer: this.initializers, input: this.inputs, output: this.outputs }),
    }).finish()
  }
}

function attr (name: string, v: AttrValue): IAttributeProto {
  const T = onnx.AttributeProto.AttributeType
  if (typeof v === 'number') return { name, type: T.INT, i: v }
  if (typeof v === 'string') return { name, type: T.STRING, s: new TextEncoder().encode(v) }
  if (Array.isArray(v)) return { name, type: T.INTS, ints: v }
  if ('float' in v) return { name, type: T.FLOAT, f: v.float }
  if ('graph' in v) return { name, type: T.GRAPH, g: v.graph }
  return { name, type: T.FLOATS, floats: v.floats }
}

function valueInfo (name: string, elemType: ElemType, dims: Dim[]): IValueInfoProto {
  return {
    name,
    type: { tensorType: { elemType, shape: { dim: dims.map(d => typeof d === 'number' ? { dimValue: d } : { dimParam: d }) } } },
  }
}
