/** Backend registry: name → factory. openvino is optional and may be unavailable here. */
import { BackendUnavailableError } from '../errors.ts'
import { createOnnxruntimeBackend } from './onnxruntime.ts'
import { createOpenvinoBackend } from './openvino.ts'
import type { Backend, BackendName } from './types.ts'

export const BACKEND_NAMES: readonly BackendName[] = ['onnxruntime', 'openvino']

export async function loadBackend (name: BackendName): Promise<Backend> {
  switch (name) {
    case 'onnxruntime': return createOnnxruntimeBackend()
    case 'openvino': return await createOpenvinoBackend()
    default: throw new BackendUnavailableError(`unknown backend "${String(name)}"`)
  }
}

