"""Interface text of the web app in English and Simplified Chinese.

Every string a person reads in the page comes from :data:`STRINGS` through :func:`t`, so the two
languages cannot drift apart silently: a key present in one language must be present in the other
(tests check it). Placeholders use ``str.format`` names.
"""

from __future__ import annotations

__all__ = ["DEFAULT_LANG", "LANGS", "LANG_CHOICES", "STRINGS", "lang_from_choice", "t"]

LANGS = ("en", "zh")
DEFAULT_LANG = "en"
# What the language switch shows, in the language it stands for.
LANG_CHOICES = {"en": "English", "zh": "中文"}

STRINGS: dict[str, dict[str, str]] = {
    "en": {
        "title": "# leaflens: what is wrong with this plant?",
        "intro": ("Take a photo of one leaf (or the pest on it), close and in daylight, and drop it here. "
                  "Several photos from the same plant give a more reliable answer: they are judged together. One plant "
                  "at a time: a new upload starts a new plant, **Add photos** adds to this one."),
        # the upload box's label: {formats} is formats or formats_heic (HEIC only when the server reads it)
        "photos": "Photos of one plant's leaves or pests ({formats}; one or several)",
        "formats": "JPEG, PNG or WebP",
        "formats_heic": "JPEG, PNG, WebP or HEIC",
        "add_photos": "Add photos (same plant)",
        "camera": "Take a photo",
        "answer_region": "Answer",
        # the upload box's own prompt (replacing Gradio's "Drop File Here - or - Click to Upload")
        "upload_drop": "Drop leaf photos here",
        "upload_or": "- or -",
        "upload_click": "click or tap to choose them",
        "upload_aria": "Choose leaf photos, or drop them here",
        "remove_photo": "Remove {name}",
        "thumbnail": "Photo {i} of {n}: {caption}",
        "gradio_upload": "Upload",
        "gradio_clear": "Clear",
        "gradio_close": "Close",
        "gradio_footer_nav": "Page footer links",
        "gradio_more_tabs": "Other tabs",
        "fullscreen": "Full screen",
        "fullscreen_exit": "Leave full screen",
        "diagnose": "Diagnose",
        "clear": "Clear",
        "language": "Language / 语言",
        "tab_diagnose": "Diagnose",
        "tab_model": "Model",
        "ranking": "Most likely",
        "verdict_heading": "### Verdict",
        "per_photo": "Each photo",
        "details": "Details (JSON, as the API returns it)",
        "examples": "Examples from the training data (click one to try it)",
        "gallery": "Your photos",
        "waiting": "Drop one or more leaf photos above and press **Diagnose**.",
        # verdicts
        "verdict_healthy": "This leaf looks **healthy** ({conf} confident).",
        "verdict_sick": "Most likely **{name}** ({conf} confident).",
        "verdict_ambiguous": ("**Unsure between {a} and {b}:** take another photo of one leaf (or pest), closer, in "
                              "daylight."),
        "verdict_ood": ("**This does not look like the leaves or pests this model knows**, so it names no disease. "
                        "The model was trained on photos of: {known}. If your plant or pest is not among these, "
                        "this model cannot judge it, and another photo will not change that; otherwise take a "
                        "photo of one leaf (or pest) filling the frame, close up, in focus and in daylight, "
                        "as taken (no filter, not pasted smaller into a frame)."),
        "verdict_ood_all": ("**None of the {n} photos looks like the leaves or pests this model knows**, so no "
                            "disease is named. The model was trained on photos of: {known}. If your plant or pest "
                            "is not among these, this model cannot judge it, and other photos will not change that; "
                            "otherwise take photos of one leaf (or pest) each, filling the frame, close up, in focus "
                            "and in daylight, as taken (no filter, not pasted smaller into a frame)."),
        "verdict_disagree": ("**The {n} photos disagree**, so no single answer is given. Each photo's answer: "
                             "{answers}. Check that the photos show the same plant, and add photos of one leaf "
                             "each, close up and in daylight."),
        "and_more": " and {n} more",
        "list_sep": ", ",
        "item_sep": "; ",  # between items that hold commas themselves
        "named_answer": "{name}: {answer}",
        "left_out_ood": ("{k} of {n} photos were left out: they do not look like the leaves or pests this model "
                         "knows ({names})."),
        "runner_up": "Next most likely: {name} ({conf}).",
        "combined": "**Combined vote of {n} photos** (probabilities averaged): ",
        "agreement": "{k} of {n} photos have this as their first answer.",
        "skipped_some": "{k} of {n} files could not be used (see below).",
        "duplicates": "{k} photo(s) are the same file as another photo here and were counted once ({names}).",
        "no_photos": "No photo was given: drop one or more leaf photos and press **Diagnose**.",
        "all_failed": "None of the files could be read as a photo. See the message for each file below.",
        "all_refused": "None of the photos could be analysed. See the message for each photo below.",
        "all_unusable": ("None of the files could be analysed: some could not be read as photos, the others were "
                         "read but could not be judged. See the message for each file below."),
        "one_failed": "**{name}** could not be read: {message}",
        "one_refused": "**{name}** was not analysed: {message}",
        "too_many": "Only the first {max} photos were used ({n} were given).",
        "sentence_gap": " ",
        "server_down": ("The server cannot be reached: it has stopped, or the network is down. The answer on this "
                        "page is the last one it gave. Once this message is gone, reload the page and add the photos "
                        "again: a restarted server no longer holds the ones sent before."),
        "not_used": "Not used: {names}; diagnose them as another plant, or in place of others.",
        # notes
        "what_it_is": "What it is",
        "what_to_do": "What to do",
        # per-photo table
        "col_photo": "Photo",
        "col_result": "Result",
        "col_conf": "Confidence",
        "photo_ambiguous": "unsure: {a} or {b}",
        "photo_ood": "not a leaf or pest this model knows",
        "refused_tag": "not analysed",
        "error_tag": "not read",
        # decode errors, by ImageDecodeError.reason (plus our own size/ext checks)
        "err_empty": "the file is empty (0 bytes).",
        "err_truncated": "the file is incomplete: the upload or copy was probably cut short.",
        "err_corrupt": "the file is damaged and cannot be read as an image.",
        "err_not_an_image": "this is not a picture, or not in a format we read (JPEG, PNG, WebP, HEIC).",
        "err_too_large": "the picture has too many pixels to process safely.",
        "err_unsupported_mode": "the picture uses a colour format we cannot convert.",
        "err_heic_unsupported": ("this is an HEIC photo (iPhone), which this server cannot read: send it as "
                                 "JPEG (iPhone: Settings > Camera > Formats > Most Compatible), or ask whoever "
                                 "runs the server to install pillow-heif (pip install 'leaflens[heic]')."),
        "err_unreadable": "the file could not be opened.",
        "err_file_too_big": "the file is {size} MB; the largest accepted is {limit} MB.",
        "err_internal": "the server failed while reading this photo.",
        "err_busy": "the server is busy right now; please try this photo again in a moment.",
        # photos that decode but are not analysed (min_side in decode, leaflens.data_prep.quality)
        "err_too_small": ("the picture is too small to show a leaf (a few dozen pixels across). Send the "
                          "original photo from the camera, not a thumbnail or a small preview."),
        "err_uniform": ("this picture is almost one flat colour, so there is no leaf to examine. Take a photo "
                        "of the leaf filling most of the frame."),
        "err_low_texture": ("this picture shows too little fine detail to examine a leaf (blurred, smooth, or mostly "
                            "plain, like a drawing or a sign). Hold the "
                            "phone steady, tap the leaf to focus, and take the photo close up in good light, "
                            "with the leaf filling most of the frame."),
        "err_no_colour": ("this is a black-and-white picture, and this model learnt from colour photos only: "
                          "many signs of disease are colours (rust, yellowing, mildew). Send a colour photo "
                          "(turn off the camera's black-and-white or mono filter)."),
        # model tab
        "model_heading": "### The model",
        "m_file": "File",
        "m_run": "Training run",
        "m_classes": "Classes",
        "m_input": "Input size",
        "m_resize": "Photo framing",
        "m_file_teacher": (" (the fine-tuned teacher, EfficientNet-Lite0, kept by the run over its students: its "
                           "report.md says why)"),
        "m_resize_crop": "centre crop of the shorter side",
        "m_resize_shorter": ("shorter side scaled to {side} px, then the middle {size} x {size} px ({share} of the "
                             "shorter side)"),
        "m_resize_pad": "whole photo, letterboxed",
        "m_resize_centre": "{framing}, then its middle {share} (chosen on the validation photos)",
        "m_provider": "Runs on",
        "m_params": "Parameters",
        "m_params_file": " (the network's; the file, with its out-of-domain check, is {size})",
        "m_params_file_plain": " (the file is {size})",
        "m_threshold": "Unsure between two classes",
        "m_threshold_below": ("when the top probability is below {threshold}, or the second class is nearly as "
                              "likely (at least {tie} of the first's probability)"),
        "m_threshold_how": ("chosen on the validation photos by `leaflens distill` or `leaflens export`, to set apart "
                            "the photos the model can least decide between its classes"),
        "m_sep": "; ",
        "m_calibrated": ("the probabilities are calibrated on the validation photos (the model's scores divided "
                         "by {temperature}), so that 80 % means right about 8 times in 10"),
        "m_threshold_cost": "{share} of the validation photos get this answer",
        "m_threshold_cost_threshold_only": ("{share} of the validation photos fall below the threshold (measured "
                                            "before near ties were answered so too: more are now)"),
        "m_threshold_default": "(default, not calibrated)",
        "m_ood": "Out-of-domain check",
        "m_ood_value": ("a photo scoring above {threshold} ({method}: how far the model's own feature statistics"
                        "{branch} are from those of its {train} training photos) gets \"does not look like the "
                        "leaves or pests this model knows\". {calibration}"),
        "m_ood_calibration": ("The threshold was set on {val} validation photos so that at most {budget} of genuine "
                              "new photos get this answer, with {confidence} confidence; it flags {flagged} of the "
                              "validation photos"),
        "m_ood_calibration_val": ("The threshold was set on {val} validation photos to flag at most {budget} of "
                                  "them; it flags {flagged}, about the share of genuine photos this check costs"),
        "m_ood_branch": (" and those of the first {blocks} blocks of an ImageNet-pretrained EfficientNet-Lite0 "
                         "(frozen, generic colour and texture detectors)"),
        "m_ood_none": ("none: this model has no out-of-domain check (it was exported before the check existed, or "
                       "without it), so a photo of something else still gets a class or \"unsure\". Re-export it "
                       "with `leaflens export` to add the check."),
        "m_accuracy": "Test accuracy",
        "m_accuracy_ci": "{acc} ({level} confidence interval {lo} to {hi}, {n} test photos)",
        "m_accuracy_unknown": "not recorded",
        "m_batching": "Batching",
        "m_batching_value": "up to {batch} photos per model call, waiting at most {wait} ms",
        "m_no_report": ("No training report was found, so accuracy with its interval, the confusion matrix and "
                        "the training curves are not shown (start with `--run <run folder>`)."),
        "confusion": "Confusion matrix",
        "curves": "Training curves",
        # corrections and the session's history (leaflens.apps.corrections, leaflens.apps.history)
        "correct_heading": "**Wrong?** Tell us the right answer: the photo is kept to train the next model.",
        "correct_label": "The right answer is",
        "correct_photo": "Which photo",
        "correct_all": "All photos of this plant",
        "correct_photo_n": "Photo {n}: {name}",
        "not_a_leaf": "Not a leaf (something else)",
        "correct_save": "Save correction",
        "correct_saved": "Saved {n} photo(s) as **{name}** for the next training run. Thank you!",
        "correct_saved_not_a_leaf": ("Saved {n} photo(s) as **{name}**. Thank you! The model has no class for such "
                                     "photos, so training does not use them yet; they are kept as examples of what "
                                     "it should not answer."),
        "correct_saved_before": "{k} of them had been saved as this already.",
        "correct_all_before": "Already saved as **{name}**: nothing new to save.",
        "correct_replaced_not_a_leaf": ("{k} of them had been saved as {names} before; that copy was removed, so "
                                        "training no longer learns them as that."),
        "correct_replaced": ("{k} of them had been saved as {names} before; that copy was removed, so the next "
                             "training run learns your latest answer only."),
        "correct_no_answer": "Diagnose a photo first, then correct the answer.",
        "correct_no_choice": "Choose the right answer first.",
        "correct_which_photo": ("These photos were not judged alike, so they may show different things: choose "
                                "which photo the "
                                "right answer is for (or \"All photos of this plant\" if it is right for every one)."),
        "correct_which_photo_left_out": ("Left out as unlike the photos this model knows: {names}. So these photos "
                                         "may show different things: choose which photo the right answer is for, or "
                                         "\"All photos of this plant\" to correct the photos it judged (those left "
                                         "out are skipped)."),
        "correct_which_photo_left_out_all": ("Left out as unlike the photos this model knows: {names}. So these "
                                             "photos may show different things: choose which photo is not a leaf, or "
                                             "\"All photos of this plant\" to save every one of them as not a "
                                             "leaf."),
        "correct_bad_photo": "That photo is not part of this answer; choose one from the list.",
        "correct_photos_changed": "The photos changed since this answer: press **Diagnose** again, then correct it.",
        "correct_unknown_class": "That answer is not one this model knows; choose one from the list.",
        "correct_skipped": "**{photo}** was not saved: {why}",
        "correct_why_not_analysed": "the model did not analyse it, so there is nothing to correct.",
        "correct_why_not_diagnosed": ("this server has no answer for this photo (it was changed, or diagnosed "
                                      "before a restart); press **Diagnose** again, then correct it."),
        "correct_why_full": ("the corrections folder on this server has no room left for it. Whoever runs the "
                             "server can move the saved photos into the training data, or allow it more space."),
        "correct_why_gone": "the photo is no longer on the server; upload it again and press **Diagnose**.",
        "correct_why_format": "it is not a JPEG, PNG, WebP, BMP, TIFF, HEIC or GIF photo, which a retrain needs.",
        "correct_why_unknown_class": "that answer is not one this model knows.",
        "correct_why_left_out": ("it was left out of this answer as not a photo this model knows. If it does show "
                                 "this, choose it by itself under **Which photo** and save again."),
        "correct_full": ("Corrections cannot be saved right now: the corrections folder on this server is full "
                         "({used} of {cap} MB)."),
        "history": "Diagnoses since this page was opened",
        "history_empty": "No diagnosis yet.",
        "history_bounded": "Only the last {n} diagnoses are kept.",
        "history_disagree": "the photos disagree",
        "and_more_photos": " and {n} more",
        "download": "Download results (CSV)",
        # uploads and privacy (leaflens.apps.uploads, leaflens.apps.privacy)
        "err_gone": ("this photo is no longer on the server: uploaded photos are deleted once answered. Add it "
                     "again and press **Diagnose**."),
        "privacy": ("**Privacy.** Your photos go only to the computer that runs this app; nothing is sent anywhere "
                    "else (unless the app was started with `--share`, which relays the page through gradio.live). "
                    "{kept} {corrections}"),
        "privacy_kept": ("There they are kept in `{folder}` while they are diagnosed and deleted {when}; photos "
                         "never diagnosed are deleted after {unanswered} minutes, and all of them when the app "
                         "stops."),
        "privacy_when_grace": "within {seconds} seconds of their answer",
        "privacy_when_keep": "{minutes} minutes after their answer",
        "privacy_unmanaged": "There they stay in the server's temporary folder until it is emptied.",
        "privacy_corrections": ("A photo is kept for longer only when you correct its answer (**Wrong?**): it is "
                                "then saved in `{folder}` to train the next model."),
        "privacy_no_corrections": "No photo is kept for training.",
        # model tab in plain words (leaflens.apps.model_info)
        "m_demo_banner": ("**Demo model: trained on drawn leaves, not real photos.** Its answers about a real leaf "
                          "mean nothing: train a model on photos of your own crop before using it in the field."),
        "m_chance_banner": ("**On its validation photos this model could not be told apart from guessing.** Its "
                            "answers may mean nothing yet, however sure they look: train it again (more epochs, more "
                            "photos, photos in the right class folders) before relying on it."),
        "m_knows": "What it recognises",
        "m_knows_value": "{n} classes: {names}",
        "m_crops": "Crops",
        "m_crops_synthetic": "none in particular: the leaves were drawn by a program",
        "m_crops_unknown": "not named in the class notes",
        "m_trained_on": "Trained on",
        "m_trained_synthetic": "{n} drawn leaves (the demo set made by `leaflens data synth`), no real photos",
        "m_trained_photos": "{n} photos",
        "m_trained_unknown": "{n} images; the folder they came from is gone, so whether they were photos is not known",
        "m_trained_unrecorded": "not recorded in this model file (it was exported before leaflens recorded it)",
        "m_trained_split": "; {train} of them to learn from, the other {rest} to choose and test the model",
        "m_trained_unlabeled": "; and {n} more without labels, which it learned from through its teacher",
        "m_right": "How often it is right",
        "m_rel_heading": "#### How reliable each class is (on the test photos)",
        "m_rel_often": "**{name}** is often mistaken for **{other}** ({c} of {n} times); right {k} of {n} times.",
        "m_rel_sometimes": "**{name}**: right {k} of {n} times; sometimes mistaken for **{other}** ({c} times).",
        "m_rel_good": "**{name}**: right {k} of {n} times.",
        "m_rel_often_tied": ("**{name}** is often mistaken for {others} ({c} of {n} times each); "
                             "right {k} of {n} times."),
        "m_rel_sometimes_tied": ("**{name}**: right {k} of {n} times; sometimes mistaken for {others} "
                                 "({c} times each)."),
        "m_rel_sep": ", ",
        "m_rel_last": " and ",
        "m_rel_said": "When it answers **{name}**, it is right only {k} of {n} times.",
        "m_rel_few": "Too few test photos to be sure.",
        "m_rel_variant": ("The training run's per-class test results are those of the FP32 model this file was made "
                          "from; this file (FP16 or INT8) was measured as a whole, above. Serve `student.onnx` to "
                          "see them."),
        "m_rel_none": ("No per-class test results were found for this model (they come from the training run's "
                       "report: start with `--run <run folder>`)."),
        "m_numbers_heading": "#### The numbers",
    },
    "zh": {
        "title": "# leaflens：这株植物怎么了？",
        "intro": ("请在自然光下近距离拍一片叶子（或叶上的害虫），把照片拖到这里。"
                  "同一株植物的多张照片会一起判断，结果更可靠。"
                  "每次只看一株植物：新上传的照片代表一株新的植物，点 **添加照片** 可为这一株补充照片。"),
        "photos": "同一株植物的叶片或害虫照片（{formats}；一张或多张）",
        "formats": "JPEG、PNG 或 WebP",
        "formats_heic": "JPEG、PNG、WebP 或 HEIC",
        "add_photos": "添加照片（同一株）",
        "camera": "拍照",
        "answer_region": "诊断结果",
        "upload_drop": "将叶片照片拖放到此处",
        "upload_or": "- 或 -",
        "upload_click": "点击或轻触选择照片",
        "upload_aria": "选择叶片照片，或拖放到此处",
        "remove_photo": "移除 {name}",
        "thumbnail": "第 {i} 张，共 {n} 张：{caption}",
        "gradio_upload": "上传",
        "gradio_clear": "清除",
        "gradio_close": "关闭",
        "gradio_footer_nav": "页脚链接",
        "gradio_more_tabs": "更多标签页",
        "fullscreen": "全屏显示",
        "fullscreen_exit": "退出全屏",
        "diagnose": "诊断",
        "clear": "清除",
        "language": "Language / 语言",
        "tab_diagnose": "诊断",
        "tab_model": "模型",
        "ranking": "最可能的结果",
        "verdict_heading": "### 结论",
        "per_photo": "每张照片",
        "details": "详细信息（JSON，与 API 返回的相同）",
        "examples": "训练数据中的示例（点击试用）",
        "gallery": "您的照片",
        "waiting": "请在上方放入一张或多张叶片照片，然后点击 **诊断**。",
        "verdict_healthy": "这片叶子看起来 **健康**（置信度 {conf}）。",
        "verdict_sick": "最可能是 **{name}**（置信度 {conf}）。",
        "verdict_ambiguous": "**无法确定是{a}还是{b}：** 请在自然光下靠近一些，再拍一张单片叶子（或害虫）的照片。",
        "verdict_ood": ("**这看起来不像本模型认识的叶片或害虫**，因此不给出病害诊断。本模型训练时的照片类别：{known}。"
                        "如果您的作物或害虫不在其中，本模型无法判断，重拍也不会改变结果；否则请在自然光下近距离拍摄一片叶子"
                        "（或一只害虫），对准焦点，让它占满画面，直接发送原图（不加滤镜，也不要把照片缩小后放进边框里）。"),
        "verdict_ood_all": ("**这 {n} 张照片都不像本模型认识的叶片或害虫**，因此不给出病害诊断。"
                            "本模型训练时的照片类别：{known}。如果您的作物或害虫不在其中，本模型无法判断，换照片也不会改变结果；"
                            "否则请每张照片拍一片叶子（或一只害虫），在自然光下近距离拍摄，对准焦点，让它占满画面，"
                            "直接发送原图（不加滤镜，也不要把照片缩小后放进边框里）。"),
        "verdict_disagree": ("**这 {n} 张照片的结果不一致**，因此不给出单一结论。各张照片的结果：{answers}。"
                             "请确认这些照片拍的是同一株植物，并补拍几张单片叶子的近距离、自然光照片。"),
        "and_more": " 等另外 {n} 类",
        "list_sep": "、",
        "item_sep": "；",
        "named_answer": "{name}：{answer}",
        "left_out_ood": "{n} 张照片中有 {k} 张不像本模型认识的叶片或害虫，未参与判断（{names}）。",
        "runner_up": "其次可能：{name}（{conf}）。",
        "combined": "**{n} 张照片的综合判断**（概率取平均）：",
        "agreement": "{n} 张照片中有 {k} 张的首选结果与此相同。",
        "skipped_some": "{n} 个文件中有 {k} 个无法使用（见下文）。",
        "duplicates": "有 {k} 张照片与这里的另一张是同一个文件，只计算一次（{names}）。",
        "no_photos": "没有收到照片：请放入一张或多张叶片照片，然后点击 **诊断**。",
        "all_failed": "所有文件都无法作为照片读取。请查看下面每个文件的说明。",
        "all_refused": "所有照片都无法分析。请查看下面每张照片的说明。",
        "all_unusable": "所有文件都无法分析：有些无法作为照片读取，其余的已读取但无法判断。请查看下面每个文件的说明。",
        "one_failed": "无法读取 **{name}**：{message}",
        "one_refused": "未分析 **{name}**：{message}",
        "too_many": "只使用了前 {max} 张照片（共收到 {n} 张）。",
        "sentence_gap": "",
        "server_down": ("无法连接服务器：服务器已停止或网络中断。页面上的结果是它最后给出的。"
                        "此提示消失后，请刷新页面并重新添加照片：重新启动的服务器不再保存之前发送的照片。"),
        "not_used": "未使用：{names}；可作为另一株植物诊断，或替换其他照片。",
        "what_it_is": "这是什么",
        "what_to_do": "怎么处理",
        "col_photo": "照片",
        "col_result": "结果",
        "col_conf": "置信度",
        "photo_ambiguous": "不确定：{a} 或 {b}",
        "photo_ood": "不像本模型认识的叶片或害虫",
        "refused_tag": "未分析",
        "error_tag": "无法读取",
        "err_empty": "文件是空的（0 字节）。",
        "err_truncated": "文件不完整：上传或复制可能被中断了。",
        "err_corrupt": "文件已损坏，无法作为图片读取。",
        "err_not_an_image": "这不是图片，或不是我们能读取的格式（JPEG、PNG、WebP、HEIC）。",
        "err_too_large": "图片像素太多，无法安全处理。",
        "err_unsupported_mode": "图片的颜色格式无法转换。",
        "err_heic_unsupported": ("这是 HEIC 照片（iPhone），本服务器无法读取：请以 JPEG 格式发送"
                                 "（iPhone：设置 > 相机 > 格式 > 兼容性最佳），或请服务器管理员安装 pillow-heif"
                                 "（pip install 'leaflens[heic]'）。"),
        "err_unreadable": "无法打开该文件。",
        "err_file_too_big": "文件大小为 {size} MB；最大允许 {limit} MB。",
        "err_internal": "服务器读取这张照片时出错。",
        "err_busy": "服务器正忙，请稍后再试这张照片。",
        "err_too_small": ("图片太小（只有几十个像素宽），看不清叶片。请发送相机拍摄的原始照片，"
                          "不要发送缩略图或小预览图。"),
        "err_uniform": "这张图片几乎只有一种颜色，没有可以检查的叶片。请重新拍摄，让叶片占满画面的大部分。",
        "err_low_texture": ("这张图片的细节太少（模糊、过于平滑，或大部分是平涂的，如图画或标志），"
                            "无法检查叶片。请拿稳手机，点按叶片对焦，"
                            "在光线充足处靠近拍摄，让叶片占满画面的大部分。"),
        "err_no_colour": ("这是一张黑白图片，而本模型只用彩色照片训练过：许多病害的迹象是颜色（锈斑、发黄、白粉）。"
                          "请发送彩色照片（关闭相机的黑白或单色滤镜）。"),
        "model_heading": "### 模型",
        "m_file": "文件",
        "m_run": "训练记录",
        "m_classes": "类别",
        "m_input": "输入尺寸",
        "m_resize": "取景方式",
        "m_file_teacher": "（微调后的教师模型 EfficientNet-Lite0，运行时保留了它而不是学生模型：原因见 report.md）",
        "m_resize_crop": "按短边居中裁剪",
        "m_resize_shorter": "短边缩放到 {side} 像素，再取中间的 {size} x {size} 像素（短边的 {share}）",
        "m_resize_pad": "整张照片，补边",
        "m_resize_centre": "{framing}，再取中间的 {share}（在验证集照片上选定）",
        "m_provider": "运行于",
        "m_params": "参数量",
        "m_params_file": "（网络本身；含域外检查的整个文件为 {size}）",
        "m_params_file_plain": "（文件大小 {size}）",
        "m_threshold": "无法在两类之间确定",
        "m_threshold_below": "最高概率低于 {threshold}，或第二类几乎同样可能（概率达到第一类的 {tie}）时",
        "m_threshold_how": ("由 `leaflens distill` 或 `leaflens export` 在验证集照片上选定，"
                            "用来区分出模型最难在各类之间做出判断的照片"),
        "m_sep": "；",
        "m_calibrated": "概率已在验证集照片上校准（模型得分除以 {temperature}），因此 80 % 意味着大约十次中对八次",
        "m_threshold_cost": "验证集照片中有 {share} 得到这样的回答",
        "m_threshold_cost_threshold_only": ("验证集照片中有 {share} 低于该阈值"
                                            "（在近似平局也按此回答之前测得：现在会更多）"),
        "m_threshold_default": "（默认值，未校准）",
        "m_ood": "域外检查",
        "m_ood_value": ("得分高于 {threshold} 的照片（{method}：模型自身特征统计量{branch}"
                        "与其 {train} 张训练照片的差距）"
                        "会得到“不像本模型认识的叶片或害虫”的回答。{calibration}"),
        "m_ood_calibration": ("该阈值在 {val} 张验证集照片上设定，使正常的新照片中最多 {budget} 得到这一回答"
                              "（置信度 {confidence}）；它标记了 {flagged} 的验证集照片"),
        "m_ood_calibration_val": ("该阈值在 {val} 张验证集照片上设定，最多标记其中的 {budget}；实际标记 {flagged}，"
                                  "约为这项检查对正常照片的代价"),
        "m_ood_branch": ("，以及 ImageNet 预训练 EfficientNet-Lite0 前 {blocks} 个模块"
                         "（冻结的通用颜色与纹理检测器）的特征统计量"),
        "m_ood_none": ("无：本模型没有域外检查（导出时还没有这项检查，或导出时关闭了它），"
                       "因此其他东西的照片仍会得到某个类别或“不确定”的回答。"
                       "用 `leaflens export` 重新导出即可加上这项检查。"),
        "m_accuracy": "测试准确率",
        "m_accuracy_ci": "{acc}（{level} 置信区间 {lo} 至 {hi}，{n} 张测试照片）",
        "m_accuracy_unknown": "未记录",
        "m_batching": "批处理",
        "m_batching_value": "每次模型调用最多 {batch} 张照片，最多等待 {wait} 毫秒",
        "m_no_report": ("未找到训练报告，因此不显示带置信区间的准确率、混淆矩阵和训练曲线"
                        "（启动时加 `--run <训练目录>`）。"),
        "confusion": "混淆矩阵",
        "curves": "训练曲线",
        "correct_heading": "**结果不对？** 请告诉我们正确答案：照片会保留下来，用于训练下一个模型。",
        "correct_label": "正确答案是",
        "correct_photo": "哪张照片",
        "correct_all": "这株植物的所有照片",
        "correct_photo_n": "照片 {n}：{name}",
        "not_a_leaf": "不是叶片（其他东西）",
        "correct_save": "保存更正",
        "correct_saved": "已将 {n} 张照片保存为 **{name}**，将用于下一次训练。谢谢！",
        "correct_saved_not_a_leaf": ("已将 {n} 张照片保存为 **{name}**。谢谢！模型没有这类照片的类别，"
                                     "所以训练暂不使用它们；它们会被保留，作为模型不应回答的照片示例。"),
        "correct_saved_before": "其中 {k} 张之前已经按此答案保存过。",
        "correct_all_before": "已经保存为 **{name}**，无需再次保存。",
        "correct_replaced": "其中 {k} 张之前被保存为 {names}；那份副本已删除，下一次训练只采用您最新的答案。",
        "correct_replaced_not_a_leaf": ("其中 {k} 张之前被保存为 {names}；那份副本已删除，"
                                        "训练不再把它们当作该类别学习。"),
        "correct_no_answer": "请先诊断照片，再更正结果。",
        "correct_no_choice": "请先选择正确答案。",
        "correct_which_photo": ("这些照片的判断结果不同，可能拍的是不同的东西：请选择正确答案对应的是哪一张"
                                "（如果对每一张都正确，请选“这株植物的所有照片”）。"),
        "correct_which_photo_left_out": ("与本模型认识的照片不同、已被排除的照片：{names}。"
                                         "因此这些照片可能拍的是不同的东西：请选择正确答案对应的是哪一张，"
                                         "或选“这株植物的所有照片”来更正已判断的照片（被排除的照片会被跳过）。"),
        "correct_which_photo_left_out_all": ("与本模型认识的照片不同、已被排除的照片：{names}。"
                                             "因此这些照片可能拍的是不同的东西：请选择哪一张不是叶片，"
                                             "或选“这株植物的所有照片”把每一张都保存为“不是叶片”。"),
        "correct_bad_photo": "这张照片不属于本次结果，请从列表中选择。",
        "correct_photos_changed": "照片在得出结果后已更换：请再次点击 **诊断**，然后再更正。",
        "correct_unknown_class": "本模型不认识这个答案，请从列表中选择。",
        "correct_skipped": "**{photo}** 未保存：{why}",
        "correct_why_not_analysed": "模型没有分析这张照片，因此无需更正。",
        "correct_why_not_diagnosed": ("本服务器没有这张照片的诊断结果（照片已更改，或在重启前诊断）；"
                                      "请再次点击 **诊断**，然后更正。"),
        "correct_why_full": ("本服务器上的更正文件夹已没有空间存放这张照片。"
                             "服务器管理员可以把已保存的照片移入训练数据，或增加空间。"),
        "correct_why_gone": "照片已不在服务器上；请重新上传并点击 **诊断**。",
        "correct_why_format": "它不是 JPEG、PNG、WebP、BMP、TIFF、HEIC 或 GIF 照片，无法用于重新训练。",
        "correct_why_unknown_class": "本模型不认识这个答案。",
        "correct_why_left_out": ("本次结果没有采用这张照片，因为它不像本模型认识的照片。如果它确实是这个答案，"
                                 "请在 **哪张照片** 中单独选择它，再保存一次。"),
        "correct_full": "暂时无法保存更正：本服务器上的更正文件夹已满（已用 {used} MB，上限 {cap} MB）。",
        "history": "打开本页面以来的诊断",
        "history_empty": "还没有诊断记录。",
        "history_bounded": "只保留最近 {n} 次诊断。",
        "history_disagree": "照片结果不一致",
        "and_more_photos": " 等另外 {n} 张",
        "download": "下载结果（CSV）",
        "err_gone": "这张照片已不在服务器上：上传的照片在给出结果后会被删除。请重新添加，然后点击 **诊断**。",
        "privacy": ("**隐私。** 您的照片只发送到运行本应用的这台计算机，不会发送到其他任何地方"
                    "（除非应用以 `--share` 启动，此时页面经由 gradio.live 中转）。{kept}{corrections}"),
        "privacy_kept": ("照片在诊断期间保存在 `{folder}`，并在{when}删除；"
                         "上传后未诊断的照片在 {unanswered} 分钟后删除，应用停止时全部删除。"),
        "privacy_when_grace": "给出结果后 {seconds} 秒内",
        "privacy_when_keep": "给出结果 {minutes} 分钟后",
        "privacy_unmanaged": "照片会留在服务器的临时文件夹中，直到该文件夹被清空。",
        "privacy_corrections": ("只有在您纠正结果时（**结果不对？**），照片才会被长期保存在 `{folder}`，"
                                "用于训练下一个模型。"),
        "privacy_no_corrections": "不会保存任何照片用于训练。",
        "m_demo_banner": ("**演示模型：用程序绘制的叶片训练，不是真实照片。** 它对真实叶片给出的结果没有意义："
                          "在田间使用之前，请用您自己作物的照片训练模型。"),
        "m_chance_banner": ("**在验证照片上，此模型的表现与猜测无法区分。** 无论看起来多么确定，它的回答目前可能都没有"
                            "意义：请重新训练（更多轮次、更多照片、照片放在正确的类别文件夹中）后再使用。"),
        "m_knows": "能识别",
        "m_knows_value": "{n} 类：{names}",
        "m_crops": "作物",
        "m_crops_synthetic": "没有特定作物：叶片由程序绘制",
        "m_crops_unknown": "类别说明中未注明",
        "m_trained_on": "训练数据",
        "m_trained_synthetic": "{n} 张绘制的叶片（`leaflens data synth` 生成的演示数据），没有真实照片",
        "m_trained_photos": "{n} 张照片",
        "m_trained_unknown": "{n} 张图片；其来源文件夹已不存在，无法确定是否为真实照片",
        "m_trained_unrecorded": "模型文件中没有记录（导出时 leaflens 还不记录这一项）",
        "m_trained_split": "；其中 {train} 张用于学习，其余 {rest} 张用于挑选和测试模型",
        "m_trained_unlabeled": "；另有 {n} 张无标注的图片，通过教师模型学习",
        "m_right": "准确程度",
        "m_rel_heading": "#### 各类别的可靠程度（测试照片）",
        "m_rel_often": "**{name}** 常被误认为 **{other}**（{n} 次中 {c} 次）；{n} 次中认对 {k} 次。",
        "m_rel_sometimes": "**{name}**：{n} 次中认对 {k} 次；有时被误认为 **{other}**（{c} 次）。",
        "m_rel_good": "**{name}**：{n} 次中认对 {k} 次。",
        "m_rel_often_tied": "**{name}** 常被误认为 {others}（{n} 次中各 {c} 次）；{n} 次中认对 {k} 次。",
        "m_rel_sometimes_tied": "**{name}**：{n} 次中认对 {k} 次；有时被误认为 {others}（各 {c} 次）。",
        "m_rel_sep": "、",
        "m_rel_last": "、",
        "m_rel_said": "当它回答 **{name}** 时，{n} 次中只有 {k} 次是对的。",
        "m_rel_few": "测试照片太少，无法确定。",
        "m_rel_variant": ("训练记录中的各类别测试结果属于本文件所由转换的 FP32 模型；本文件（FP16 或 INT8）"
                          "只整体测过准确率（见上）。若要查看，请使用 `student.onnx`。"),
        "m_rel_none": "未找到本模型各类别的测试结果（来自训练记录中的报告：启动时加 `--run <训练目录>`）。",
        "m_numbers_heading": "#### 具体数字",
    },
}


def t(key: str, lang: str = DEFAULT_LANG, **values: object) -> str:
    """The interface string ``key`` in ``lang`` (unknown languages fall back to English)."""
    table = STRINGS.get(lang, STRINGS[DEFAULT_LANG])
    text = table[key]
    return text.format(**values) if values else text


def lang_from_choice(choice: str | None) -> str:
    """Map the language switch's value ("English", "中文", or a code) to a language code."""
    if choice in LANGS:
        return str(choice)
    for code, label in LANG_CHOICES.items():
        if choice == label:
            return code
    return DEFAULT_LANG
