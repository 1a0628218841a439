/** Which engine backend and device a --device value means, given what loads on this machine. */
import type { BackendName } from '../engine/index.ts'
import { ShoalError } from '../errors.ts'

export interface EngineChoice {
  backend: BackendName
  device: string
}

/** Pure: 'auto' prefers OpenVINO (it reaches GPU/NPU) and falls back to onnxruntime on the CPU. */
export function chooseEngine (device: string, openvinoAvailable: boolean): EngineChoice {
  if (device === 'cpu') return { backend: 'onnxruntime', device: 'CPU' }
  if (device === 'auto') return openvinoAvailable ? { backend: 'openvino', device: 'AUTO' } : { backend: 'onnxruntime', device: 'CPU' }
  if (!openvinoAvailable) {
    throw new ShoalError('SHOAL_ERR_BACKEND_UNAVAILABLE', `--device ${device} needs OpenVINO, and openvino-node is not installed here (run shoal doctor); use --device cpu`)
  }
  return { backend: 'openvino', device }
}

/**
 * `--device` as given: one device, or a comma-separated list with one device per stage of a model
 * run as a local chain (`cpu,GPU,NPU`: the first stage on onnxruntime's CPU, the others on
 * OpenVINO's GPU and NPU).
 */
export function deviceList (device: string): string[] {
  return device.split(',').map(d => d.trim())
}
